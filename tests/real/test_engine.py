"""The embedded engine (the trainer's rollouts) on SmolLM2-135M-Instruct: greedy tokens of real chat prompts equal
transformers' greedy, and their log-probs equal transformers' float64 forward."""

from __future__ import annotations

import pytest
import torch

from tests.real import reference

pytestmark = [pytest.mark.slow, pytest.mark.real]


def test_greedy_equals_transformers(smollm2, chat_prompts, hf_greedy, hf64, tokenizer):
    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.rollout.embedded import EmbeddedEngine
    from megaopd.rollout.protocol import SamplingParams

    # context_length: the rows' own length (the model's 8192 positions x 3 rows would be 1 GB of cache).
    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=smollm2, max_batch_size=len(chat_prompts), context_length=256))
    samples = engine.generate(chat_prompts, SamplingParams(temperature=0.0, max_new_tokens=reference.NEW_TOKENS))
    compared, worst = 0, 0.0
    for prompt, sample, ref in zip(chat_prompts, samples, hf_greedy):
        n = reference.assert_greedy_matches(sample.output_ids, ref, f"engine, prompt {tokenizer.decode(prompt)!r}")
        compared += n
        expected = reference.token_logprobs(hf64, prompt + sample.output_ids, first=len(prompt))
        worst = max(worst, float((expected - torch.tensor(sample.output_logprobs, dtype=expected.dtype)).abs().max()))
        if ref.tokens[-1] == tokenizer.eos_token_id and n == len(ref.tokens):
            assert sample.finish_reason == "stop" and sample.output_ids[-1] == tokenizer.eos_token_id
    print(
        f"engine: {compared} greedy tokens equal transformers'; max |log-prob - float64| {worst:.2e}; "
        f"responses: {[tokenizer.decode(s.output_ids) for s in samples]}"
    )
    assert compared >= len(chat_prompts) * 8  # near-ties are rare: most of every response is compared
    assert worst < reference.LOGPROB_TOL

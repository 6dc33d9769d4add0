"""A small Engine for tests: HF transformers `generate` on a loaded model, implementing the protocol.

Stands in for megaopd.rollout.embedded until that lands; not a second production engine.
"""
from __future__ import annotations

import torch

from megaopd.rollout.protocol import Sample, SamplingParams


class HFGenerateEngine:
    def __init__(self, model, tokenizer):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.calls = []

    def generate(self, prompts, params: SamplingParams):
        self.calls.append((len(prompts), params))
        pad = self.tokenizer.pad_token_id
        eos = set(params.stop_token_ids) | {self.tokenizer.eos_token_id}
        width = max(len(p) for p in prompts)
        # Left padding, repeated n times per prompt (prompt-major).
        rows = [p for p in prompts for _ in range(params.n)]
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows])
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows])
        if params.seed is not None:
            torch.manual_seed(params.seed)
        greedy = params.temperature < 1e-6
        with torch.no_grad():
            out = self.model.generate(
                input_ids=ids, attention_mask=attn, max_new_tokens=params.max_new_tokens,
                do_sample=not greedy, temperature=None if greedy else params.temperature,
                top_p=params.top_p if not greedy else None, top_k=None if params.top_k < 0 else params.top_k,
                eos_token_id=sorted(eos), pad_token_id=pad, output_scores=True, return_dict_in_generate=True,
            )
        gen = out.sequences[:, width:]
        logp = torch.stack(out.scores, 1).log_softmax(-1)  # [N, steps, V]
        samples = []
        for r, prompt in enumerate(rows):
            toks, lps, reason = [], [], "length"
            for t, tok in enumerate(gen[r].tolist()):
                toks.append(tok)
                lps.append(float(logp[r, t, tok]))
                if tok in eos:
                    reason = "stop"
                    break
            samples.append(Sample(list(prompt), toks, lps, reason))
        return samples

    def update_weights(self, named_tensors, weight_version=None):
        self.model.load_state_dict(dict(named_tensors), strict=False)

    def release_memory(self):
        pass

    def resume_memory(self):
        pass

    def health(self):
        return True


class ScriptedEngine:
    """Returns canned response texts in order (one per sequence), to test scoring arithmetic exactly."""

    def __init__(self, tokenizer, texts, finish_reasons=None):
        self.tokenizer = tokenizer
        self.texts = list(texts)
        self.reasons = list(finish_reasons or ["stop"] * len(self.texts))
        self.calls = []

    def generate(self, prompts, params: SamplingParams):
        self.calls.append((len(prompts), params))
        out = []
        for p in prompts:
            for _ in range(params.n):
                text, reason = self.texts.pop(0), self.reasons.pop(0)
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                out.append(Sample(list(p), ids, [0.0] * len(ids), reason))
        return out

"""Tiny random HF models (built once per session with transformers, no download) and their HF outputs.

Each entry of `hf_models`: the HF directory, a batch of token ids (two micro-batches of 2 x 9), and the
float32 transformers logits / log-probs of that batch, which every megatron layout must reproduce.
"""

import pytest
import torch

MODEL_NAMES = ("tiny-qwen2", "tiny-qwen2-tied", "tiny-llama", "tiny-qwen3", "tiny-qwen3-tied", "tiny-qwen3-moe")


def hf_reference(model, ids):
    with torch.no_grad():
        logits = model(ids).logits.float()
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    return logits, logprobs


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    from megaopd.models.presets import make_hf_model

    root = tmp_path_factory.mktemp("hf")
    out = {}
    for i, name in enumerate(MODEL_NAMES):
        path = str(root / name)
        model = make_hf_model(name, path, seed=i)
        ids = torch.randint(0, model.config.vocab_size, (4, 9), generator=torch.Generator().manual_seed(i))
        logits, logprobs = hf_reference(model, ids)
        out[name] = dict(hf_dir=path, ids=ids, logits=logits, logprobs=logprobs)
    return out

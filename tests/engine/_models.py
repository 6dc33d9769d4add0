"""Tiny random Qwen2 HF models for the engine, serving and rollout tests: built from a config, saved into a tmp "
"dir, no download."""

from __future__ import annotations

import functools

import torch

VOCAB = 128
EOS = 2


def tiny_qwen2_config(**overrides):
    from transformers import Qwen2Config

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=EOS,
        bos_token_id=1,
        pad_token_id=0,
        rope_theta=10000.0,
    )
    kw.update(overrides)
    return Qwen2Config(**kw)


def build_tiny_qwen2(path, seed: int = 0, eos_boost: float = 0.0, **overrides) -> str:
    """Saves a random tiny Qwen2 to `path`; eos_boost > 0 raises EOS's logit (lm_head bias-free:
    the EOS row of lm_head is aligned with the final norm's output direction via a large weight)."""
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(tiny_qwen2_config(**overrides)).float()
    if eos_boost:
        with torch.no_grad():
            # The final RMSNorm output has positive mean per channel often enough: a positive constant
            # EOS row makes EOS's logit large for most states.
            model.lm_head.weight[EOS].fill_(eos_boost)
            model.model.norm.weight.abs_()
    model.save_pretrained(str(path))
    return str(path)


def random_state_dict(path, seed: int) -> dict[str, torch.Tensor]:
    """HF-named tensors of another random model with the same config as `path`."""
    from transformers import AutoConfig, Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(AutoConfig.from_pretrained(str(path))).float()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@functools.lru_cache(maxsize=4)
def _load(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def hf_logprobs(path_or_model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """Independent reference: one unpadded forward of prompt + output, log_softmax(logits / T) at the outputs."""
    model = _load(path_or_model) if isinstance(path_or_model, str) else path_or_model
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    t = temperature if temperature >= 1e-6 else 1.0
    lp = torch.log_softmax(logits / t, dim=-1)
    P = len(prompt)
    return lp[P - 1 : P - 1 + len(output)].gather(-1, torch.tensor(output).unsqueeze(-1)).squeeze(-1)

"""Part b: transformers vs megatron-core (megaopd.models: build_gpt_model + load_hf_weights) logits and log-probs
of one random Qwen2.5-shaped model on the device, in float32 (a tight bound) and bfloat16; and the packed path
(THD, cu_seqlens: models/packed_attention.py, torch's varlen flash kernel in bf16 on CUDA): one row packing
prefixes of uneven lengths of the batch's sequences must give every sequence's log-probs as the padded path
does (causal attention: a prefix's outputs are the full row's first positions).

bfloat16 has no fixed bound: the same model's transformers bf16 output is compared with its transformers
float32 output first (the bf16 noise floor of this model and batch), and megatron bf16 must be within a small
multiple of that floor, both against float32 transformers and against bf16 transformers.
"""

from __future__ import annotations

import torch

from megaopd.gpucheck.build import hf_config_dict, random_hf_model
from megaopd.gpucheck.report import Table, max_abs

FP32_BOUND = 1e-3  # max |logit| / |log-prob| difference, float32 kernels of both libraries (TF32 off)
BF16_FACTOR = 3.0  # megatron bf16 error <= BF16_FACTOR x transformers bf16 error (+ BF16_SLACK)
BF16_SLACK = 1e-2


def _hf_out(model, ids):
    with torch.no_grad():
        logits = model(ids).logits.float()
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    return logits, lp


def packed_lengths(batch: int, seq: int) -> list[int]:
    """Uneven prefix lengths, one per row (the full row, half, a fifth, ...; at least 2 tokens)."""
    return [max(2, seq // (1 + 2 * i) + 3 * i) if i else seq for i in range(batch)]


def _megatron_out(cfg, hf_state, ids, dtype, vocab, lengths):
    """Padded logits [b, s, V] and log-probs [b, s - 1], and the packed row's log-probs per sequence."""
    from megaopd import ops
    from megaopd.batching.packing import PackedRow, Segment
    from megaopd.models.builder import BuildOptions, build_gpt_model
    from megaopd.models.weights import Placement, load_hf_weights
    from megaopd.parallel.groups import Layout
    from megaopd.scoring.runner import _packed_seq_params

    model = build_gpt_model(cfg, Layout(), None, BuildOptions(dtype=dtype, init_weights=False)).eval()
    load_hf_weights(model, hf_state, cfg, Placement())
    b, s = ids.shape
    pos = torch.arange(s, device=ids.device).expand(b, s)
    row = PackedRow([Segment(0, i, n) for i, n in enumerate(lengths)])
    with torch.no_grad():
        logits = model(ids, pos, attention_mask=None)[..., :vocab].float()  # padding columns dropped
        lp = ops.vocab_parallel_logprobs(logits[:, :-1].contiguous(), ids[:, 1:])
        packed_ids = row.tokens({0: ids.cpu()}, 0).to(ids.device)
        packed = model(
            packed_ids, row.position_ids().to(ids.device), None, packed_seq_params=_packed_seq_params(row, ids.device)
        )[..., :vocab].float()
        packed_lp = ops.vocab_parallel_logprobs(packed[:, :-1].contiguous(), packed_ids[:, 1:])
    del model
    return logits, lp, row.unpack(packed_lp)


def _prefix_delta(per_seq: list[torch.Tensor], lp_BT: torch.Tensor) -> float:
    """max |packed - padded| over every sequence's positions."""
    return max(float((got - lp_BT[i, : got.numel()]).abs().max()) for i, got in enumerate(per_seq) if got.numel())


def check_models(
    table: Table, device, shape: str, vocab: int, num_layers: int | None, batch: int, seq: int, dtypes
) -> None:
    from megaopd.models.hf_config import read_hf_config
    from megaopd.parallel.dist import init_distributed
    from megaopd.parallel.groups import Layout, initialize_actor_layout

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 in both libraries
    torch.backends.cudnn.allow_tf32 = False
    init_distributed()
    initialize_actor_layout(Layout(1, 1))
    raw = hf_config_dict(shape, vocab, num_layers)
    cfg = read_hf_config(raw)
    label = f"{shape} ({raw['num_hidden_layers']} layers, V={vocab}, {batch}x{seq} tokens)"
    hf = random_hf_model(raw, device, torch.float32, seed=3)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(5)).to(device)
    lengths = packed_lengths(batch, seq)
    packed_label = f"packed THD vs padded {label}, lengths {lengths}"
    ref_logits, ref_lp = _hf_out(hf, ids)
    table.info("b", f"HF model {label}", "float32", "max abs logit", float(ref_logits.abs().max()))
    state = {k: v for k, v in hf.state_dict().items()}
    if "float32" in dtypes:
        with table.guard("b", f"megatron vs HF {label}", "float32"):
            m_logits, m_lp, m_packed = _megatron_out(cfg, state, ids, torch.float32, vocab, lengths)
            table.le(
                "b", f"megatron vs HF {label}", "float32", "max abs Δ logits", max_abs(m_logits, ref_logits), FP32_BOUND
            )
            table.le(
                "b", f"megatron vs HF {label}", "float32", "max abs Δ log-probs", max_abs(m_lp, ref_lp), FP32_BOUND
            )
            table.le(
                "b",
                f"megatron {packed_label}",
                "float32",
                "max abs Δ log-probs (vs megatron padded)",
                _prefix_delta(m_packed, m_lp),
                FP32_BOUND,
            )
            table.le(
                "b",
                f"megatron {packed_label}",
                "float32",
                "max abs Δ log-probs (vs HF)",
                _prefix_delta(m_packed, ref_lp),
                FP32_BOUND,
            )
            del m_logits, m_lp
    if "bfloat16" in dtypes:
        with table.guard("b", f"megatron vs HF {label}", "bfloat16"):
            hf16 = hf.to(torch.bfloat16)  # in place: the float32 copy is no longer needed
            del hf
            h_logits, h_lp = _hf_out(hf16, ids)
            floor_logits, floor_lp = max_abs(h_logits, ref_logits), max_abs(h_lp, ref_lp)
            table.info("b", f"HF bf16 vs HF fp32 {label}", "bfloat16", "max abs Δ logits (noise floor)", floor_logits)
            table.info("b", f"HF bf16 vs HF fp32 {label}", "bfloat16", "max abs Δ log-probs (noise floor)", floor_lp)
            state16 = {k: v for k, v in hf16.state_dict().items()}
            del hf16
            m_logits, m_lp, m_packed = _megatron_out(cfg, state16, ids, torch.bfloat16, vocab, lengths)
            for what, got, want, floor in (
                ("logits", m_logits, ref_logits, floor_logits),
                ("log-probs", m_lp, ref_lp, floor_lp),
            ):
                table.le(
                    "b",
                    f"megatron bf16 vs HF fp32 {label}",
                    "bfloat16",
                    f"max abs Δ {what}",
                    max_abs(got, want),
                    BF16_FACTOR * floor + BF16_SLACK,
                )
            for what, got, want, floor in (
                ("logits", m_logits, h_logits, floor_logits),
                ("log-probs", m_lp, h_lp, floor_lp),
            ):
                table.le(
                    "b",
                    f"megatron bf16 vs HF bf16 {label}",
                    "bfloat16",
                    f"max abs Δ {what}",
                    max_abs(got, want),
                    BF16_FACTOR * floor + BF16_SLACK,
                )
            # the varlen flash kernel vs the padded path's attention: both bf16, so the same floor bounds it
            table.le(
                "b",
                f"megatron bf16 {packed_label}",
                "bfloat16",
                "max abs Δ log-probs (vs megatron padded)",
                _prefix_delta(m_packed, m_lp),
                BF16_FACTOR * floor_lp + BF16_SLACK,
            )
            table.le(
                "b",
                f"megatron bf16 {packed_label}",
                "bfloat16",
                "max abs Δ log-probs (vs HF fp32)",
                _prefix_delta(m_packed, ref_lp),
                BF16_FACTOR * floor_lp + BF16_SLACK,
            )

"""Code under test, run on vocab shards: in-process (group=None) or in spawned gloo workers (module-level
functions so that spawned processes can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.losses import _reference as R


def shard(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    v = x.shape[-1] // world
    return x[..., rank * v : (rank + 1) * v].contiguous()


def build_inputs(batch: dict, group, rank: int, world: int, dtype: torch.dtype, **overrides):
    """LossInputs for a reference batch on this rank's vocab shard, plus the two logits leaves."""
    from megaopd.losses import LossInputs

    logits = shard(batch["logits"], rank, world).to(dtype).requires_grad_(True)
    golden = shard(batch["golden_logits"], rank, world).to(dtype).requires_grad_(True)
    fields = dict(
        logits_BTv=logits,
        token_ids_BT=batch["ids"],
        loss_mask_BT=batch["mask"],
        tp_group=group,
        temperature=batch["temperature"],
        seq_ids_BT=batch["seq_ids"],
        old_logprobs_BT=batch["old_lp"].to(dtype),
        teacher_logprobs_BT=batch["teacher_lp"].to(dtype),
        teacher_topk_ids_BTK=batch["t_topk_ids"],
        teacher_topk_logprobs_BTK=batch["t_topk_lp"].to(dtype),
        teacher_topk_mask_BTK=batch["t_topk_mask"],
        student_topk_ids_BTK=batch["s_topk_ids"],
        student_topk_teacher_logprobs_BTK=batch["s_topk_teacher_lp"].to(dtype),
        teacher_logits_BTv=shard(batch["teacher_logits"], rank, world).to(dtype),
        ref_logits_BTv=shard(batch["ref_logits"], rank, world).to(dtype),
        rewards_S=batch["rewards"].to(dtype),
        group_ids_S=batch["groups"],
        golden_logits_BTv=golden,
        golden_ids_BT=batch["golden_ids"],
        golden_mask_BT=batch["golden_mask"],
        teacher_spans_BT=batch["spans"],
    )
    fields.update(overrides)
    return LossInputs(**fields), logits, golden


def run_cases(group, rank: int, world: int, dtype_name: str = "float32") -> dict:
    """Every case of R.CASES on this rank's shard: {(label, batch): (loss, grad shard, golden grad shard,
    metrics)}, plus the student top-k ids the helper finds (compared with the reference's)."""
    from megaopd.losses import build_loss, student_topk_support

    dtype = getattr(torch, dtype_name)
    batches = {name: R.make_batch(**kw) for name, kw in R.BATCHES.items()}
    out = {}
    for label, batch_name, loss_name, cfg in R.CASES:
        batch = batches[batch_name]
        inputs, logits, golden = build_inputs(batch, group, rank, world, dtype)
        result = build_loss(loss_name, cfg)(inputs)
        loss, metrics = result.total, result.metrics
        loss.backward()
        out[(label, batch_name)] = (
            float(loss.detach()),
            logits.grad.double() if logits.grad is not None else torch.zeros_like(logits, dtype=torch.float64),
            golden.grad.double() if golden.grad is not None else None,
            {k: float(v) for k, v in metrics.items()},
        )
    for batch_name, batch in batches.items():
        logits = shard(batch["logits"], rank, world).to(dtype)
        ids = student_topk_support(logits, R.K_STUDENT, group=group, temperature=batch["temperature"])
        out[("student_topk_ids", batch_name)] = ids
    return out


def tp_worker(rank: int, world: int, dtype_name: str):
    """One spawn per world size: the TP checks, and at world 2 the data-parallel aggregation checks too."""
    out = {"tp": _picklable(run_cases(dist.group.WORLD, rank, world, dtype_name))}
    if world == 2:
        out["dp"] = dp_aggregation_diffs(rank, world)
    return out


def _picklable(obj):
    """Tensors as numpy arrays: torch.multiprocessing would pass tensors through shared memory whose
    owner (the worker) exits before the parent reads them."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy()
    if isinstance(obj, dict):
        return {k: _picklable(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_picklable(v) for v in obj)
    return obj


# -------------------------------------------------------------------------------- aggregation (DP, micro-batches)
AGG_LOSSES = [
    ("opd", {}),
    ("sft", {}),
    ("lsm", dict(k=R.K_TEACHER)),
    ("grpo", {}),
    ("stable_opd", dict(sft_weight=0.5, ref_kl_weight=0.3)),
]
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def _with_mode(name, cfg, mode):
    if name == "stable_opd":
        return dict(cfg, opd=dict(aggregation=mode), sft=dict(aggregation=mode), ref_kl=dict(aggregation=mode))
    return dict(cfg, aggregation=mode)


def _agg_batch():
    """A batch of 8 rows (4 prompt groups of 2) whose logits come from a shared weight W [H, V]:
    logits = features @ W, so gradients from micro-batches / DP ranks add up on W like a model's."""
    g = torch.Generator().manual_seed(11)
    a, b = R.make_batch(seed=21), R.make_batch(seed=22, scale=5.0)
    batch = {}
    for key in a:
        if isinstance(a[key], torch.Tensor):
            batch[key] = torch.cat([a[key], b[key]]) if key not in ("groups",) else torch.cat([a[key], b[key] + 2])
        else:
            batch[key] = a[key]
    batch["seq_ids"] = None
    H = 6
    batch["features"] = torch.randn(8, 9, H, generator=g, dtype=torch.float64)
    batch["golden_features"] = torch.randn(4, 6, H, generator=g, dtype=torch.float64)
    batch["W"] = torch.randn(H, R.V, generator=g, dtype=torch.float64)
    return batch


def _rows(batch, rows, golden_rows):
    out = dict(batch)
    for key in (
        "ids",
        "mask",
        "old_lp",
        "teacher_lp",
        "t_topk_ids",
        "t_topk_lp",
        "t_topk_mask",
        "s_topk_ids",
        "s_topk_teacher_lp",
        "teacher_logits",
        "ref_logits",
        "rewards",
        "groups",
        "features",
    ):
        out[key] = batch[key][rows]
    for key in ("golden_ids", "golden_mask", "golden_features"):
        out[key] = batch[key][golden_rows]
    return out


def _w_grad(part, name, cfg, counts=None):
    """dL/dW of one micro-batch (float64, TP=1)."""
    from megaopd.losses import LossInputs, build_loss

    W = part["W"].clone().requires_grad_(True)
    logits = part["features"] @ W
    golden = part["golden_features"] @ W
    counts = counts or {}
    inputs = LossInputs(
        logits_BTv=logits,
        token_ids_BT=part["ids"],
        loss_mask_BT=part["mask"],
        temperature=part["temperature"],
        old_logprobs_BT=part["old_lp"],
        teacher_logprobs_BT=part["teacher_lp"],
        teacher_topk_ids_BTK=part["t_topk_ids"],
        teacher_topk_logprobs_BTK=part["t_topk_lp"],
        teacher_topk_mask_BTK=part["t_topk_mask"],
        ref_logits_BTv=part["ref_logits"],
        rewards_S=part["rewards"],
        group_ids_S=part["groups"],
        golden_logits_BTv=golden,
        golden_ids_BT=part["golden_ids"],
        golden_mask_BT=part["golden_mask"],
        **counts,
    )
    loss = build_loss(name, cfg)(inputs).total
    loss.backward()
    return W.grad, float(loss)


def _global_counts(parts):
    from megaopd.losses import local_counts

    tok = seq = gtok = gseq = 0.0
    for p in parts:
        n, s = local_counts(p["mask"])
        gn, gs = local_counts(p["golden_mask"])
        tok, seq, gtok, gseq = tok + n, seq + s, gtok + gn, gseq + gs
    return dict(global_num_tokens=tok, global_num_seqs=seq, global_num_golden_tokens=gtok, global_num_golden_seqs=gseq)


# Splits by whole prompt groups (grpo needs whole groups; seq-mean needs whole sequences).
MICRO_SPLITS = [([0, 1, 2, 3, 4, 5], [0, 1, 2]), ([6, 7], [3])]
DP_SPLITS = [([0, 1, 4, 5], [0, 3]), ([2, 3, 6, 7], [1, 2])]


def micro_batch_diffs() -> dict:
    """{(loss, mode): max |grad(sum of micro-batches) - grad(one batch)|} plus the loss values."""
    batch = _agg_batch()
    out = {}
    for name, cfg in AGG_LOSSES:
        for mode in MODES:
            c = _with_mode(name, cfg, mode)
            full_grad, full_loss = _w_grad(batch, name, c)
            parts = [_rows(batch, rows, grows) for rows, grows in MICRO_SPLITS]
            counts = _global_counts(parts)
            grads, losses = zip(*[_w_grad(p, name, c, counts) for p in parts])
            out[(name, mode)] = (
                float((sum(grads) - full_grad).abs().max()),
                sum(losses) - full_loss,
                float(full_grad.abs().max()),
            )
    return out


def dp_aggregation_diffs(rank: int, world: int) -> dict:
    """Each DP rank holds part of the batch; counts all-reduced; W.grad summed over ranks."""
    from megaopd.losses import all_reduce_counts, local_counts

    batch = _agg_batch()
    out = {}
    for name, cfg in AGG_LOSSES:
        for mode in MODES:
            c = _with_mode(name, cfg, mode)
            full_grad, _ = _w_grad(batch, name, c)
            rows, grows = DP_SPLITS[rank]
            part = _rows(batch, rows, grows)
            counts = all_reduce_counts([*local_counts(part["mask"]), *local_counts(part["golden_mask"])])
            grad, _ = _w_grad(
                part,
                name,
                c,
                dict(
                    zip(
                        ["global_num_tokens", "global_num_seqs", "global_num_golden_tokens", "global_num_golden_seqs"],
                        counts,
                    )
                ),
            )
            # Gradients are SUMMED over DP ranks (megatron DDP: calculate_per_token_loss=True, or average
            # and multiply the loss by the DP size): the global count already is the whole step's.
            dist.all_reduce(grad)
            out[(name, mode)] = (float((grad - full_grad).abs().max()), float(full_grad.abs().max()))
    return out

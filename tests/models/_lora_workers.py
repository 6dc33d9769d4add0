"""Worker functions for tests/models/test_lora.py (module level: spawned processes import them by name).

Every case gives back full (unsharded) tensors, gathered over TP, so the test compares them with a float64
single-process reference: the formula W x + (alpha / r) B A x for one layer, transformers for a whole model.
"""

import torch
import torch.distributed as dist

LORA = dict(enabled=True, rank=3, alpha=6.0)
MODEL_LAYOUTS = ((1, 1), (2, 1), (1, 2))  # (tp, pp) over 2 ranks


def _gather(t, group, dim):
    if group.size() == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _linear_case(kind, pgs, case):
    """One ColumnParallelLinear ("column", as linear_qkv) or RowParallelLinear ("row", as linear_proj) with an
    adapter whose full A, B, W come from `case`; returns the full output and gradients, and whether the
    adapters-off output equals the base's bit for bit."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from megaopd.models import compat
    from megaopd.models.config import LoRAConfig
    from megaopd.models.lora import adapters, adapters_off, apply_lora

    tp, r = pgs.tp.size(), pgs.tp.rank()
    W, A, B, x, g = (case[k].float() for k in ("W", "A", "B", "x", "g"))
    out_f, in_f = W.shape
    config = compat.make_transformer_config(
        num_layers=1, hidden_size=in_f, num_attention_heads=tp, tensor_model_parallel_size=tp,
        **compat.cpu_config_overrides(),
    )  # fmt: skip
    holder = torch.nn.Module()
    if kind == "column":
        lin = ColumnParallelLinear(
            in_f, out_f, config=config, init_method=torch.nn.init.zeros_, bias=False, gather_output=False,
            tp_group=pgs.tp,
        )  # fmt: skip
        holder.linear_qkv = lin
        w_shard, x_in, g_out = W.chunk(tp, 0)[r], x.clone(), g.chunk(tp, -1)[r]
    else:
        lin = RowParallelLinear(
            in_f, out_f, config=config, init_method=torch.nn.init.zeros_, bias=False, input_is_parallel=True,
            skip_bias_add=False, tp_group=pgs.tp,
        )  # fmt: skip
        holder.linear_proj = lin
        w_shard, x_in, g_out = W.chunk(tp, 1)[r], x.chunk(tp, -1)[r].clone(), g
    with torch.no_grad():
        lin.weight.copy_(w_shard)
    x_in.requires_grad_(True)
    base_out = lin(x_in)[0].detach().clone()
    apply_lora(holder, LoRAConfig(**LORA, targets=["qkv" if kind == "column" else "proj"]), pgs.tp)
    (_, adapter), *_ = list(adapters(holder))
    with torch.no_grad():
        adapter.lora_A.copy_(A if kind == "column" else A.chunk(tp, 1)[r])
        adapter.lora_B.copy_(B.chunk(tp, 0)[r] if kind == "column" else B)
    y = lin(x_in)[0]
    (y * g_out).sum().backward()
    with adapters_off(holder):
        off = lin(x_in)[0].detach()
    column = kind == "column"
    return dict(
        y=_gather(y, pgs.tp, -1) if column else y.detach().clone(),
        dA=adapter.lora_A.grad.clone() if column else _gather(adapter.lora_A.grad, pgs.tp, 1),
        dB=_gather(adapter.lora_B.grad, pgs.tp, 0) if column else adapter.lora_B.grad.clone(),
        dx=x_in.grad.clone() if column else _gather(x_in.grad, pgs.tp, -1),
        off_is_base=bool(torch.equal(off, base_out)),
        frozen=not lin.weight.requires_grad,
        trainable=sorted(n for n, p in holder.named_parameters() if p.requires_grad),
    )


def lora_linears(rank, world_size, case):
    """Both linear kinds at TP=1 and TP=2 (2 ranks): {(tp, kind): results} from this rank."""
    from megaopd.parallel.groups import Layout, build_process_groups, initialize_actor_layout

    initialize_actor_layout(Layout(1, 1))
    out = {}
    for tp in (1, 2):
        pgs = build_process_groups(Layout(tp=tp))
        for kind in ("column", "row"):
            out[(tp, kind)] = _linear_case(kind, pgs, case[kind])
    return out


def _set_adapters(model, cfg, hf_adapter, pgs, pp):
    """Copies HF-named adapter tensors (peft names) into this stage's adapters through the one mapping."""
    from megaopd.models.builder import StageInfo
    from megaopd.models.weights import adapted_linears, adapter_rules, model_state, shard_tensor

    st = StageInfo.of(pgs)
    state = model_state(model)
    with torch.no_grad():
        for rule in adapter_rules(cfg, adapted_linears(state), st.pp_rank, pp):
            state[rule.megatron].copy_(
                shard_tensor(rule, [hf_adapter[n] for n in rule.hf], cfg, st.tp_rank, st.tp_size)
            )


def lora_model(rank, world_size, hf_dir, ids, hf_adapter):
    """A tiny GPTModel with LoRA on every linear at each of MODEL_LAYOUTS: log-probs with the adapters, with
    them off and of the base before LoRA; the adapters' gradients of sum(log-probs) in peft names (gathered
    over TP and PP); the merged and adapter exports. {(tp, pp): results} (log-probs on the last stage only)."""
    from megaopd import ops
    from megaopd.batching.micro_batches import ScoringMicroBatch
    from megaopd.models.config import LoRAConfig
    from megaopd.models.gather import gather_adapter_weights, gather_hf_weights
    from megaopd.models.hf_config import layers_per_stage, read_hf_config
    from megaopd.models.lora import adapter_parameters, adapters_off, apply_lora
    from megaopd.models.weights import model_state, strip_wrapper_prefix
    from megaopd.parallel.groups import Layout, build_process_groups, initialize_actor_layout
    from megaopd.scoring.runner import PipelineRunner
    from tests.models._workers import _build_loaded

    initialize_actor_layout(Layout(1, 1))
    cfg = read_hf_config(hf_dir)
    out = {}
    for tp, pp in MODEL_LAYOUTS:
        pgs = build_process_groups(Layout(tp=tp, pp=pp))
        model = _build_loaded(cfg, hf_dir, tp, pp, pgs)
        runner = PipelineRunner(model, pgs, cfg.vocab_size)

        def logprobs(mb, shard, _partner, pgs=pgs):
            lp = ops.vocab_parallel_logprobs(shard[:, :-1], mb.tokens_BS[:, 1:], pgs.tp)
            return lp.sum(), lp.detach().clone()

        def score(forward_only=True, runner=runner, logprobs=logprobs):
            res = runner.run([ScoringMicroBatch(ids)], logprobs, forward_only=forward_only)
            return None if res is None else res[0]

        with torch.no_grad():
            base = score()
        names = apply_lora(
            model, LoRAConfig(**LORA, targets=["all"]), pgs.tp, layer_offset=pgs.pp.rank() * layers_per_stage(cfg, pp)
        )
        _set_adapters(model, cfg, hf_adapter, pgs, pp)
        model.config.calculate_per_token_loss = True  # the schedule divides nothing (as the trainer sets it)
        with_lora = score(forward_only=False)
        with torch.no_grad(), adapters_off(model):
            off = score()
        grads = {strip_wrapper_prefix(n): p.grad for n, p in model.named_parameters() if p.grad is not None}
        hf_grads = dict(gather_adapter_weights(grads, cfg, pgs.tp, pgs.pp))  # gradients map as their tensors
        merged = dict(gather_hf_weights(model_state(model), cfg, pgs.tp, pgs.pp))
        exported = dict(gather_adapter_weights(model_state(model), cfg, pgs.tp, pgs.pp))
        out[(tp, pp)] = dict(
            base=base,
            lora=with_lora,
            off=off,
            off_equals_base=None if base is None else bool(torch.equal(off, base)),
            grads=hf_grads,
            merged=merged,
            exported=exported,
            adapted=len(names),
            trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
            adapter_params=sum(p.numel() for p in adapter_parameters(model)),
        )
    return out


def lora_checkpoint(rank, world_size, hf_dir, ids, hf_adapter, ckpt_dir):
    """A LoRA model at TP=2 (adapters set from hf_adapter) saved as a megaopd checkpoint; returns its log-probs
    (rank 0 after a broadcast: both ranks are the one last stage)."""
    from megaopd import ops
    from megaopd.batching.micro_batches import ScoringMicroBatch
    from megaopd.models.checkpoint import save_model_checkpoint
    from megaopd.models.config import LoRAConfig
    from megaopd.models.hf_config import read_hf_config
    from megaopd.models.lora import apply_lora
    from megaopd.parallel.groups import Layout, initialize_actor_layout
    from megaopd.scoring.runner import PipelineRunner
    from tests.models._workers import _build_loaded

    cfg = read_hf_config(hf_dir)
    pgs = initialize_actor_layout(Layout(tp=2))
    model = _build_loaded(cfg, hf_dir, 2, 1, pgs)
    apply_lora(model, LoRAConfig(**LORA, targets=["all"]), pgs.tp)
    _set_adapters(model, cfg, hf_adapter, pgs, 1)

    def logprobs(mb, shard, _partner):
        lp = ops.vocab_parallel_logprobs(shard[:, :-1], mb.tokens_BS[:, 1:], pgs.tp)
        return lp.sum(), lp

    with torch.no_grad():
        (lp,) = PipelineRunner(model, pgs, cfg.vocab_size).run([ScoringMicroBatch(ids)], logprobs, True)
    save_model_checkpoint(model, ckpt_dir, cfg, pgs, hf_side_dir=hf_dir, extra_meta={"source": hf_dir})
    return lp

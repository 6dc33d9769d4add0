"""Worker functions for tests/parallel (module level so spawned processes can import them)."""

import torch
import torch.distributed as dist


def _tiny_gpt(pg_collection=None, tp=1, pp=1, vocab=96):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=128,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        normalization="RMSNorm",
        gated_linear_unit=True,
        add_bias_linear=False,
    )
    kwargs = {} if pg_collection is None else {"pg_collection": pg_collection}
    torch.manual_seed(0)
    return GPTModel(
        cfg,
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=vocab,
        max_sequence_length=32,
        position_embedding_type="rope",
        **kwargs,
    )


def _full_logits(model, tp_group):
    ids = torch.arange(12).reshape(2, 6) % 90
    pos = torch.arange(6).expand(2, 6)
    out = model(ids, pos, attention_mask=None)  # [b, s, V/tp]
    shards = [torch.empty_like(out) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(shards, out.contiguous(), group=tp_group)
    return torch.cat(shards, dim=-1)


def actor_tp1_teacher_tp2(rank, world_size):
    """Actor layout TP=1 (global state) and a teacher at TP=2 through its own groups."""
    from megaopd.parallel.groups import Layout, build_process_groups, initialize_actor_layout

    actor_pgs = initialize_actor_layout(Layout(tp=1, pp=1))
    teacher_pgs = build_process_groups(Layout(tp=2, pp=1))
    assert actor_pgs.tp.size() == 1 and teacher_pgs.tp.size() == 2
    teacher = _tiny_gpt(teacher_pgs, tp=2)
    reference = _tiny_gpt(None, tp=1)  # same seed, same weights under use_cpu_initialization
    with torch.no_grad():
        t = _full_logits(teacher, teacher_pgs.tp)
        r = reference(torch.arange(12).reshape(2, 6) % 90, torch.arange(6).expand(2, 6), None)
    return float((t - r).abs().max())


def teacher_reads_no_global_state(rank, world_size):
    """Teacher at TP=2 through its own groups while parallel_state holds a TP=1 actor layout whose
    getters raise: the teacher's build and forward must not read the global state.

    One exception, a megatron-core 0.16 wart: RowParallelLinear.forward calls
    linear_with_grad_accumulation_and_async_allreduce(tp_group=None), which looks up the global TP group
    and never uses it (no sequence parallelism, no dgrad all-reduce). That lookup gets a wrong
    (singleton) group, so any real use would corrupt the logits that are compared with a TP=1 model.
    """
    import traceback

    from megatron.core import parallel_state

    from megaopd.parallel.groups import Layout, build_process_groups, initialize_actor_layout

    initialize_actor_layout(Layout(tp=1, pp=1))
    teacher_pgs = build_process_groups(Layout(tp=2, pp=1))
    wrong_group = [dist.new_group([r]) for r in range(world_size)][rank]
    ids, pos = torch.arange(12).reshape(2, 6) % 90, torch.arange(6).expand(2, 6)
    with torch.no_grad():
        expected = _tiny_gpt(None, tp=1)(ids, pos, None)

    saved = {}
    # The attention scratch buffer is shared by every layout (no group, no rank).
    allowed = {"get_global_memory_buffer"}

    def poisoned(name):
        def getter(*a, **k):
            callers = [f.name for f in traceback.extract_stack()]
            if (
                name == "get_tensor_model_parallel_group"
                and "linear_with_grad_accumulation_and_async_allreduce" in callers
            ):
                return wrong_group
            raise AssertionError(f"teacher code read parallel_state.{name}")

        return getter

    for name in dir(parallel_state):
        if name.startswith("get_") and name not in allowed and callable(getattr(parallel_state, name)):
            saved[name] = getattr(parallel_state, name)
            setattr(parallel_state, name, poisoned(name))
    try:
        teacher = _tiny_gpt(teacher_pgs, tp=2)
        with torch.no_grad():
            logits = _full_logits(teacher, teacher_pgs.tp)
    finally:
        for name, fn in saved.items():
            setattr(parallel_state, name, fn)
    return float((logits - expected).abs().max())


def moe_router_aux_loss(rank, world_size, hf_dir):
    """A tiny Qwen3-MoE at EP=2 (the actor layout): the router gets the auxiliary-loss gradient only
    when built as a trained student (train_router=True), never as a frozen teacher."""
    from megaopd.models.builder import BuildOptions, StageInfo, build_gpt_model
    from megaopd.models.hf_config import read_hf_config
    from megaopd.models.hf_io import HFWeights
    from megaopd.models.weights import Placement, load_hf_weights
    from megaopd.parallel.groups import Layout, initialize_actor_layout

    pgs = initialize_actor_layout(Layout(tp=1, pp=1, ep=2))
    cfg = read_hf_config(hf_dir)
    ids = torch.arange(16).reshape(2, 8) % cfg.vocab_size
    pos = torch.arange(8).expand(2, 8)
    grads = {}
    for train_router in (True, False):
        model = build_gpt_model(cfg, Layout(ep=2), pgs, BuildOptions(init_weights=False, train_router=train_router))
        st = StageInfo.of(pgs)
        load_hf_weights(
            model,
            HFWeights(hf_dir),
            cfg,
            Placement(tp_rank=st.tp_rank, pp_rank=st.pp_rank, ep_rank=pgs.ep.rank(), ep_size=2),
        )
        model(ids, pos, attention_mask=None).float().pow(2).mean().backward()
        router = model.decoder.layers[0].mlp.router.weight.grad.clone()
        expert = model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.weight.grad
        grads[train_router] = (router, expert is not None and bool(expert.abs().sum() > 0))
        aux_on = model.config.moe_aux_loss_coeff
        grads[(train_router, "coeff")] = aux_on
    return {
        "router_grad_diff": float((grads[True][0] - grads[False][0]).abs().max()),
        "experts_have_grad": grads[True][1] and grads[False][1],
        "coeff": (grads[(True, "coeff")], grads[(False, "coeff")]),
    }


def teacher_moe_ep2_beside_dense_actor(rank, world_size, hf_dir):
    """Actor layout TP=1 EP=1 in parallel_state; a MoE teacher at EP=2 through its own groups equals
    the same teacher at EP=1 (each rank a different batch: tokens really cross EP ranks)."""
    from megaopd.models.builder import BuildOptions, StageInfo, build_gpt_model
    from megaopd.models.hf_config import read_hf_config
    from megaopd.models.hf_io import HFWeights
    from megaopd.models.weights import Placement, load_hf_weights
    from megaopd.parallel.groups import Layout, build_process_groups, initialize_actor_layout

    initialize_actor_layout(Layout(tp=1, pp=1))
    cfg = read_hf_config(hf_dir)
    ids = (torch.arange(16).reshape(2, 8) * (rank + 3)) % cfg.vocab_size  # a different batch per rank
    pos = torch.arange(8).expand(2, 8)
    out = []
    for ep in (2, 1):
        pgs = build_process_groups(Layout(tp=1, pp=1, ep=ep))
        model = build_gpt_model(cfg, Layout(ep=ep), pgs, BuildOptions(init_weights=False, train_router=False)).eval()
        st = StageInfo.of(pgs)
        load_hf_weights(
            model,
            HFWeights(hf_dir),
            cfg,
            Placement(tp_rank=st.tp_rank, pp_rank=st.pp_rank, ep_rank=pgs.ep.rank(), ep_size=ep),
        )
        with torch.no_grad():
            out.append(model(ids, pos, attention_mask=None))
    return float((out[0] - out[1]).abs().max())


def start_facts(rank, world_size):
    """How this worker started and what it sees: (start method, a variable of the caller's, sum of ranks)."""
    import multiprocessing as mp
    import os

    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return mp.get_start_method(allow_none=True), os.environ.get("MEGAOPD_TEST_VAR"), float(t)


def raise_in_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("rank one fails on purpose")
    return rank


def leaves_work_for_exit(rank, world_size, folder):
    """Registers an exit handler and starts a non-daemon thread, each writing a file once the worker is done:
    a spawned worker that skips the interpreter's teardown must still join the one and run the other."""
    import atexit
    import os
    import threading
    import time

    def write(name):
        with open(os.path.join(folder, f"{name}_{rank}"), "w") as f:
            f.write("done")

    atexit.register(write, "atexit")
    threading.Thread(target=lambda: (time.sleep(0.5), write("thread")), daemon=False).start()
    return rank

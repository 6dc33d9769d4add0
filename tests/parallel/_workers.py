"""Worker functions for tests/parallel (module level so spawned processes can import them)."""
import torch
import torch.distributed as dist


def _tiny_gpt(pg_collection=None, tp=1, pp=1, vocab=96):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        attention_dropout=0.0, hidden_dropout=0.0, normalization="RMSNorm", gated_linear_unit=True,
        add_bias_linear=False,
    )
    kwargs = {} if pg_collection is None else {"pg_collection": pg_collection}
    torch.manual_seed(0)
    return GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=vocab,
                    max_sequence_length=32, position_embedding_type="rope", **kwargs)


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
            if name == "get_tensor_model_parallel_group" and \
                    "linear_with_grad_accumulation_and_async_allreduce" in callers:
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

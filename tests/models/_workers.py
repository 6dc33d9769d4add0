"""Worker functions for tests/models (module level: spawned processes import them by name).

One spawn of 4 gloo workers checks every layout, so the ~10 s start-up of megatron is paid once.
"""
import torch
import torch.distributed as dist

LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2))  # (tp, pp)


def _gather_tp(shard, group):
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _run_model(model, cfg, pgs, ids):
    """Full-vocab logits (test-only TP gather) and sharded log-probs, on the last stage; else None."""
    from megaopd.models.forward import forward_only
    from megaopd.models.logprobs import token_logprobs_from_shard

    def on_logits(shard, batch):
        x = batch["input_ids"]
        lp = token_logprobs_from_shard(shard[:, :-1], x[:, 1:], cfg.vocab_size, pgs.tp)
        return _gather_tp(shard, pgs.tp)[..., : cfg.vocab_size], lp

    # Two micro-batches of 2 sequences: the pipeline schedule interleaves them across stages.
    out = forward_only(model, [{"input_ids": ids[:2]}, {"input_ids": ids[2:]}], pgs, on_logits)
    if not out:
        return None, None
    return torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])


def _build_loaded(cfg, hf_dir, tp, pp, pgs):
    from megaopd.models.builder import StageInfo, build_gpt_model
    from megaopd.models.hf_io import HFWeights
    from megaopd.models.weights import load_hf_weights

    model = build_gpt_model(cfg, tp, pp, pg_collection=pgs, init_weights=False).eval()
    st = StageInfo.of(pgs)
    load_hf_weights(model, HFWeights(hf_dir), cfg, st.tp_rank, tp, st.pp_rank, pp)
    return model


def parity_all_layouts(rank, world_size, models, ckpt_root, bf16_hf_dir=None):
    """For each layout and model: logits and log-probs vs HF, and HF -> megatron -> HF bit-exactness.

    Layouts use explicit process groups (build_process_groups, as a teacher would) while megatron's
    global parallel_state holds another layout (TP=1, PP=1): so nothing may read the global groups.
    Then a TP=2 PP=2 checkpoint (actor layout) is loaded at TP=1 PP=1.
    Returns {(name, tp, pp, what): value} from this rank.
    """
    from megaopd.models.checkpoint import load_model_checkpoint, save_model_checkpoint
    from megaopd.models.hf_config import read_hf_config
    from megaopd.models.hf_io import HFWeights
    from megaopd.models.weights import hf_shapes
    from megaopd.sync.gather import gather_hf_weights, model_state
    from megaopd.parallel.groups import Layout, build_process_groups, initialize_actor_layout

    res = {}
    initialize_actor_layout(Layout(1, 1))
    for tp, pp in LAYOUTS:
        pgs = build_process_groups(Layout(tp, pp))
        for name, m in models.items():
            cfg = read_hf_config(m["hf_dir"])
            model = _build_loaded(cfg, m["hf_dir"], tp, pp, pgs)
            logits, lp = _run_model(model, cfg, pgs, m["ids"])
            if logits is not None:
                res[(name, tp, pp, "logits")] = float((logits - m["logits"]).abs().max())
                res[(name, tp, pp, "logprobs")] = float((lp - m["logprobs"]).abs().max())
            hf = HFWeights(m["hf_dir"])
            exported = dict(gather_hf_weights(model_state(model), cfg, pgs.tp, pgs.pp))
            bad = [n for n in hf if n not in exported or exported[n].dtype != hf[n].dtype
                   or not torch.equal(exported[n], hf[n])]
            extra = sorted(set(exported) - set(hf_shapes(cfg)))
            res[(name, tp, pp, "roundtrip_mismatches")] = bad + extra

    if bf16_hf_dir is not None:
        # bfloat16 weights survive load + TP gather + PP broadcast bit-exactly, in bfloat16
        # (megatron's local-spec norms are float32 params: the export casts them back).
        cfg = read_hf_config(bf16_hf_dir)
        pgs = build_process_groups(Layout(2, 2))
        from megaopd.models.builder import StageInfo, build_gpt_model
        from megaopd.models.weights import load_hf_weights

        model = build_gpt_model(cfg, 2, 2, pg_collection=pgs, dtype=torch.bfloat16, init_weights=False)
        st = StageInfo.of(pgs)
        hf = HFWeights(bf16_hf_dir)
        load_hf_weights(model, hf, cfg, st.tp_rank, 2, st.pp_rank, 2)
        exported = dict(gather_hf_weights(model_state(model), cfg, pgs.tp, pgs.pp))
        res[("bf16", "roundtrip_mismatches")] = [n for n in hf if exported[n].dtype != torch.bfloat16
                                                 or not torch.equal(exported[n], hf[n])]

    # Checkpoint written by the actor layout TP=2 PP=2, read back at TP=1 PP=1.
    for name in ("tiny-qwen2", "tiny-qwen2-tied"):
        m = models[name]
        cfg = read_hf_config(m["hf_dir"])
        ckpt = f"{ckpt_root}/{name}"
        pgs = initialize_actor_layout(Layout(2, 2))
        model = _build_loaded(cfg, m["hf_dir"], 2, 2, pgs)
        logits22, _ = _run_model(model, cfg, pgs, m["ids"])
        save_model_checkpoint(model, ckpt, cfg, pgs, hf_side_dir=m["hf_dir"])
        # Broadcast the TP2/PP2 logits from the last rank (a last-stage rank: PP is the slowest
        # dimension of megatron's rank order) so every rank can compare.
        buf = logits22 if logits22 is not None else torch.empty_like(m["logits"])
        dist.broadcast(buf, src=world_size - 1)
        pgs = initialize_actor_layout(Layout(1, 1))
        from megaopd.models.builder import build_gpt_model

        fresh = build_gpt_model(cfg, 1, 1, pg_collection=pgs).eval()  # random init, then overwritten
        meta = load_model_checkpoint(fresh, ckpt, pgs)
        logits11, _ = _run_model(fresh, cfg, pgs, m["ids"])
        res[(name, "ckpt22->11", "logits_vs_tp2pp2")] = float((logits11 - buf).abs().max())
        res[(name, "ckpt22->11", "logits_vs_hf")] = float((logits11 - m["logits"]).abs().max())
        res[(name, "ckpt22->11", "meta")] = (meta["tp"], meta["pp"], meta["dtype"])
    return res

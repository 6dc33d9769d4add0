"""Worker functions for tests/models (module level: spawned processes import them by name).

One spawn of 4 gloo workers checks every layout, so the ~10 s start-up of megatron is paid once.
"""

import torch
import torch.distributed as dist

LAYOUTS = ((1, 1), (2, 1), (1, 2), (2, 2))  # (tp, pp)
MOE_LAYOUTS = tuple((tp, pp, 1) for tp, pp in LAYOUTS) + ((1, 1, 2), (2, 1, 2), (1, 2, 2), (1, 1, 4))  # (tp, pp, ep)
# Checkpoints written at an actor layout (tp, pp, ep) and read back at TP=1 PP=1 EP=1.
CKPT_LAYOUTS = {
    "tiny-qwen2": (2, 2, 1),
    "tiny-qwen2-tied": (2, 2, 1),
    "tiny-qwen3": (2, 2, 1),
    "tiny-qwen3-moe": (2, 1, 2),
}


def _gather_tp(shard, group):
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _run_model(model, cfg, pgs, ids):
    """Full-vocab logits (test-only TP gather) and sharded log-probs, on the last stage; else None."""
    from megaopd import ops
    from megaopd.batching.micro_batches import ScoringMicroBatch
    from megaopd.scoring.runner import PipelineRunner

    def on_logits(mb, shard, _partner):
        x = mb.tokens_BS
        lp = ops.vocab_parallel_logprobs(shard[:, :-1], x[:, 1:], pgs.tp)
        return shard.sum() * 0, (_gather_tp(shard, pgs.tp)[..., : cfg.vocab_size], lp)

    # Two micro-batches of 2 sequences: the pipeline schedule interleaves them across stages.
    with torch.no_grad():
        out = PipelineRunner(model, pgs, cfg.vocab_size).run(
            [ScoringMicroBatch(ids[:2]), ScoringMicroBatch(ids[2:])], on_logits, forward_only=True
        )
    if not out:
        return None, None
    return torch.cat([o[0] for o in out]), torch.cat([o[1] for o in out])


def _build_loaded(cfg, hf_dir, tp, pp, pgs, ep=1):
    from megaopd.models.builder import BuildOptions, StageInfo, build_gpt_model
    from megaopd.models.hf_io import HFWeights
    from megaopd.models.weights import Placement, load_hf_weights
    from megaopd.parallel.groups import Layout

    model = build_gpt_model(
        cfg, Layout(tp=tp, pp=pp, ep=ep), pgs, BuildOptions(init_weights=False, train_router=False)
    ).eval()
    st = StageInfo.of(pgs)
    place = Placement(tp_rank=st.tp_rank, tp_size=tp, pp_rank=st.pp_rank, pp_size=pp, ep_rank=pgs.ep.rank(), ep_size=ep)
    load_hf_weights(model, HFWeights(hf_dir), cfg, place)
    return model


def _layouts(cfg):
    return MOE_LAYOUTS if cfg.is_moe else tuple((tp, pp, 1) for tp, pp in LAYOUTS)


def parity_all_layouts(rank, world_size, models, ckpt_root, bf16_hf_dir=None):
    """For each layout and model: logits and log-probs vs HF, and HF -> megatron -> HF bit-exactness.

    Layouts use explicit process groups (build_process_groups, as a teacher would) while megatron's
    global parallel_state holds another layout (TP=1, PP=1): so nothing may read the global groups.
    Then a TP=2 PP=2 checkpoint (actor layout) is loaded at TP=1 PP=1.
    Returns {(name, tp, pp, what): value} from this rank.
    """
    from megaopd.models.checkpoint import load_model_checkpoint, save_model_checkpoint
    from megaopd.models.gather import gather_hf_weights, model_state
    from megaopd.models.hf_config import read_hf_config
    from megaopd.models.hf_io import HFWeights
    from megaopd.models.weights import gather_stage_hf_weights, hf_shapes
    from megaopd.parallel.groups import Layout, build_process_groups, initialize_actor_layout

    res = {}
    initialize_actor_layout(Layout(1, 1))
    cfgs = {name: read_hf_config(m["hf_dir"]) for name, m in models.items()}
    for tp, pp, ep in MOE_LAYOUTS:
        names = [n for n in models if (tp, pp, ep) in _layouts(cfgs[n])]
        if not names:
            continue
        pgs = build_process_groups(Layout(tp, pp, ep))
        for name in names:
            m, cfg = models[name], cfgs[name]
            key = (name, tp, pp) if ep == 1 else (name, tp, pp, ep)
            model = _build_loaded(cfg, m["hf_dir"], tp, pp, pgs, ep)
            logits, lp = _run_model(model, cfg, pgs, m["ids"])
            if logits is not None:
                res[key + ("logits",)] = float((logits - m["logits"]).abs().max())
                res[key + ("logprobs",)] = float((lp - m["logprobs"]).abs().max())
            hf = HFWeights(m["hf_dir"])
            if ep == 1:
                exported = dict(gather_hf_weights(model_state(model), cfg, pgs.tp, pgs.pp))
            else:  # this stage's tensors at TP x EP; the test unites the stages' names
                exported = dict(gather_stage_hf_weights(model_state(model), cfg, pgs.tp, pgs.ep, pgs.pp.rank(), pp))
            res[key + ("exported",)] = sorted(exported)
            bad = [
                n
                for n in exported
                if n not in hf or exported[n].dtype != hf[n].dtype or not torch.equal(exported[n], hf[n])
            ]
            if ep == 1:
                bad += [n for n in hf if n not in exported]
            res[key + ("roundtrip_mismatches",)] = bad + sorted(set(exported) - set(hf_shapes(cfg)))

    if bf16_hf_dir is not None:
        # bfloat16 weights survive load + TP gather + PP broadcast bit-exactly, in bfloat16
        # (megatron's local-spec norms are float32 params: the export casts them back).
        cfg = read_hf_config(bf16_hf_dir)
        pgs = build_process_groups(Layout(2, 2))
        from megaopd.models.builder import BuildOptions, StageInfo, build_gpt_model
        from megaopd.models.weights import Placement, load_hf_weights

        model = build_gpt_model(cfg, Layout(tp=2, pp=2), pgs, BuildOptions(dtype=torch.bfloat16, init_weights=False))
        st = StageInfo.of(pgs)
        hf = HFWeights(bf16_hf_dir)
        load_hf_weights(model, hf, cfg, Placement(tp_rank=st.tp_rank, tp_size=2, pp_rank=st.pp_rank, pp_size=2))
        exported = dict(gather_hf_weights(model_state(model), cfg, pgs.tp, pgs.pp))
        res[("bf16", "roundtrip_mismatches")] = [
            n for n in hf if exported[n].dtype != torch.bfloat16 or not torch.equal(exported[n], hf[n])
        ]

    # Checkpoints written by an actor layout (TP=2 PP=2, or TP=2 EP=2 for the MoE), read back at 1/1/1.
    for name, (tp, pp, ep) in CKPT_LAYOUTS.items():
        if name not in models:
            continue
        m, cfg = models[name], cfgs[name]
        ckpt = f"{ckpt_root}/{name}"
        pgs = initialize_actor_layout(Layout(tp, pp, ep))
        model = _build_loaded(cfg, m["hf_dir"], tp, pp, pgs, ep)
        logits_saved, _ = _run_model(model, cfg, pgs, m["ids"])
        save_model_checkpoint(model, ckpt, cfg, pgs, hf_side_dir=m["hf_dir"])
        # Broadcast the saved layout's logits from the last rank (a last-stage rank: PP is the slowest
        # dimension of megatron's rank order) so every rank can compare.
        buf = logits_saved if logits_saved is not None else torch.empty_like(m["logits"])
        dist.broadcast(buf, src=world_size - 1)
        pgs = initialize_actor_layout(Layout(1, 1))
        from megaopd.models.builder import BuildOptions, build_gpt_model

        fresh = build_gpt_model(cfg, Layout(), pgs).eval()  # random init, then overwritten
        meta = load_model_checkpoint(fresh, ckpt, pgs)
        logits11, _ = _run_model(fresh, cfg, pgs, m["ids"])
        res[(name, "ckpt->11", "logits_vs_saved")] = float((logits11 - buf).abs().max())
        res[(name, "ckpt->11", "logits_vs_hf")] = float((logits11 - m["logits"]).abs().max())
        res[(name, "ckpt->11", "meta")] = (meta["tp"], meta["pp"], meta["dtype"])
    return res


def packed_vs_alone(rank, world_size, models, lengths):
    """Per layout (tp, pp) in PACKED_LAYOUTS and model: logits of sequences of very uneven lengths packed
    into one THD row vs each sequence run alone (padded path, b = 1); max |difference| on the last stage."""
    from megaopd.batching.micro_batches import ScoringMicroBatch
    from megaopd.batching.packing import PackedRow, Segment
    from megaopd.models.hf_config import read_hf_config
    from megaopd.parallel.groups import Layout, build_process_groups, initialize_actor_layout
    from megaopd.scoring.runner import PipelineRunner

    res = {}
    initialize_actor_layout(Layout(1, 1))
    for tp, pp in PACKED_LAYOUTS:
        pgs = build_process_groups(Layout(tp, pp))
        for name, m in models.items():
            cfg = read_hf_config(m["hf_dir"])
            model = _build_loaded(cfg, m["hf_dir"], tp, pp, pgs)
            gen = torch.Generator().manual_seed(7)
            seqs = [torch.randint(0, cfg.vocab_size, (1, n), generator=gen) for n in lengths]
            runner = PipelineRunner(model, pgs, cfg.vocab_size)

            def logits_of(mb, shard, _partner, pgs=pgs, cfg=cfg):
                return shard.sum() * 0, _gather_tp(shard, pgs.tp)[..., : cfg.vocab_size]

            row = PackedRow([Segment(0, i, n) for i, n in enumerate(lengths)], total=sum(lengths) + 3)
            tokens = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
            for i, s in enumerate(seqs):
                tokens[i, : s.shape[1]] = s[0]
            with torch.no_grad():
                packed = runner.run([ScoringMicroBatch(row.tokens({0: tokens}, 0), packed=row)], logits_of, True)
                alone = [runner.run([ScoringMicroBatch(s)], logits_of, True) for s in seqs]
            if packed is None:
                continue
            diff = 0.0
            for i, s in enumerate(seqs):
                o = row.offsets[i]
                diff = max(diff, float((packed[0][0, o : o + s.shape[1]] - alone[i][0][0]).abs().max()))
            res[(name, tp, pp)] = diff
    return res


PACKED_LAYOUTS = ((1, 1), (2, 1), (1, 2))


def results_queue_survives_preemption_signals(rank, world_size, method):
    """Starts megatron's checkpoint-result Manager as save_model_checkpoint does (with `method`), sends it the
    signals srun delivers to every process of a step, and returns whether it still carries a result."""
    import os
    import signal
    import time

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megaopd.models import compat

    compat.start_checkpoint_results_queue(method)
    queue = filesystem_async._results_queue
    manager_pid = queue._manager._process.pid  # the proxy's manager (multiprocessing keeps it there)
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        os.kill(manager_pid, sig)
    time.sleep(0.5)
    queue.put({"rank": rank})
    return queue.get(timeout=10)

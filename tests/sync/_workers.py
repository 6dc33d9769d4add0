"""Spawned workers for tests/sync: a Megatron actor pushing its weights into a rollout engine."""

from __future__ import annotations

import torch
import torch.distributed as dist

PROBE = [[1, 5, 9, 14, 30, 41, 7, 7, 60, 2], [1, 80, 81, 82, 3, 9, 100, 12]]


def actor_to_server(rank, world_size, hf_dir, url, tp, pp, noise_seed):
    """Builds an actor at (tp, pp) from hf_dir with perturbed weights (a "trained" student), measures the
    server's log-probs of PROBE before and after pushing the actor's weights over a gloo group, and the
    actor's own log-probs. Returns (max |before - actor|, max |after - actor|) on rank 0."""
    from megaopd.batching.micro_batches import ScoringBatches
    from megaopd.models.builder import StageInfo
    from megaopd.models.config import ModelConfig
    from megaopd.models.hf_io import HFWeights
    from megaopd.models.weights import Placement, load_hf_weights
    from megaopd.parallel.groups import Layout, initialize_actor_layout
    from megaopd.rollout.client import HttpEngine
    from megaopd.rollout.config import RolloutConfig
    from megaopd.rollout.pool import EnginePool
    from megaopd.scoring.passes import ScoreRequest, score_tokens
    from megaopd.scoring.runner import PipelineRunner
    from megaopd.sync import WeightSync
    from megaopd.trainer.roles import load_role_model

    pgs = initialize_actor_layout(Layout(tp, pp))
    actor = load_role_model(ModelConfig(path=hf_dir, tp=tp, pp=pp), pgs, trainable=False)
    # The same perturbation on every rank, in HF space, then sharded: a consistent new model.
    gen = torch.Generator().manual_seed(noise_seed)
    weights = HFWeights(hf_dir)
    perturbed = {n: weights[n] + 0.05 * torch.randn(weights[n].shape, generator=gen) for n in sorted(weights.keys())}
    st = StageInfo.of(pgs)
    load_hf_weights(
        actor.model, perturbed, actor.hf, Placement(tp_rank=st.tp_rank, tp_size=tp, pp_rank=st.pp_rank, pp_size=pp)
    )

    engine = EnginePool([HttpEngine(url)]) if rank == 0 else None

    def engine_logprobs():
        box = [[engine.prompt_logprobs(p)[1:] for p in PROBE] if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    before = engine_logprobs()
    sync = WeightSync(engine, RolloutConfig(engine="remote", urls=[url]), rank)
    stats = sync.push(actor.model, actor.hf, pgs, weight_version=f"noise{noise_seed}")
    assert (stats is None) == (rank != 0) and (rank != 0 or stats.transports == ["dist_group"])
    after = engine_logprobs()
    S = max(len(p) for p in PROBE)
    tokens = torch.zeros(len(PROBE), S, dtype=torch.long)
    for b, p in enumerate(PROBE):
        tokens[b, : len(p)] = torch.tensor(p)
    actor_lp = score_tokens(
        PipelineRunner(actor.model, pgs, actor.hf.vocab_size), tokens, ScoringBatches(2), ScoreRequest(1.0)
    ).logprobs_BT

    def gap(engine_lp):
        return max(abs(e - a) for b, lp in enumerate(engine_lp) for e, a in zip(lp, actor_lp[b, : len(lp)].tolist()))

    sync.close()
    if rank == 0:
        engine.close()
    return (gap(before), gap(after)) if rank == 0 else None


class _Recording:
    """An engine wrapper that logs memory and weight calls in order (an "in_process" engine)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []
        self.weight_transports = engine.weight_transports

    def weight_targets(self):
        return [self]

    @property
    def released_tags(self):
        return self.engine.released_tags

    def release_memory(self, tags=None):
        self.engine.release_memory(tags)

    def resume_memory(self, tags=None):
        self.calls.append(f"resume({list(tags)})")
        self.engine.resume_memory(tags)

    def update_weights(self, named, weight_version=None):
        self.calls.append(f"update_weights({weight_version})")
        self.engine.update_weights(named, weight_version=weight_version)


def push_and_record(rank, world_size, hf_dir):
    from megaopd.batching.micro_batches import ScoringBatches
    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.models.config import ModelConfig
    from megaopd.parallel.groups import Layout, initialize_actor_layout
    from megaopd.rollout.config import RolloutConfig
    from megaopd.rollout.embedded import EmbeddedEngine
    from megaopd.scoring.passes import ScoreRequest, score_tokens
    from megaopd.scoring.runner import PipelineRunner
    from megaopd.sync import WeightSync
    from megaopd.trainer.roles import load_role_model

    pgs = initialize_actor_layout(Layout(world_size, 1))
    actor = load_role_model(ModelConfig(path=hf_dir, tp=world_size, pp=1), pgs, trainable=False)
    with torch.no_grad():  # a "trained" actor: not the weights the engine loaded
        for p in actor.model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    engine = _Recording(EmbeddedEngine(EmbeddedEngineConfig(hf_dir=hf_dir))) if rank == 0 else None
    sync = WeightSync(engine, RolloutConfig(engine="embedded", colocated=True), rank)
    out = {}
    sync.push(actor.model, actor.hf, pgs, weight_version="v0")
    if rank == 0:
        out["startup"], engine.calls = engine.calls, []
        engine.release_memory()  # as the trainer does after generating
    sync.push(actor.model, actor.hf, pgs, weight_version="v1")
    tokens = torch.tensor([PROBE[0]])
    actor_lp = score_tokens(
        PipelineRunner(actor.model, pgs, actor.hf.vocab_size), tokens, ScoringBatches(1), ScoreRequest(1.0)
    ).logprobs_BT
    if rank != 0:
        return None
    out["after_release"] = engine.calls
    engine_lp = engine.engine.prompt_logprobs(PROBE[0])[1:]
    out["gap"] = max(abs(e - a) for e, a in zip(engine_lp, actor_lp[0, : len(engine_lp)].tolist()))
    return out


def moe_actor_to_embedded(rank, world_size, hf_dir, out_dir, tp, pp, ep):
    """A Qwen3-MoE actor at (tp, pp, ep) with perturbed weights (a "trained" student) gathers its HF tensors
    (every rank: bit-exact against the perturbed HF tensors?) and pushes them through WeightSync into an
    embedded engine on rank 0, which was built from the unperturbed model. Returns on rank 0
    {"mismatches": names whose gathered tensor differs, on any rank, "names_ok": the gather's names are
    exactly the checkpoint's, "perturbed_dir": the perturbed HF dir, "engine_lp": the engine's log-probs of
    PROBE[0] after the push}."""
    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.models.builder import StageInfo
    from megaopd.models.config import ModelConfig
    from megaopd.models.gather import gather_hf_weights, model_state
    from megaopd.models.hf_io import HFWeights, save_hf_dir
    from megaopd.models.weights import Placement, load_hf_weights
    from megaopd.parallel.groups import Layout, initialize_actor_layout
    from megaopd.rollout.config import RolloutConfig
    from megaopd.rollout.embedded import EmbeddedEngine
    from megaopd.sync import WeightSync
    from megaopd.sync.weight_sync import expert_group
    from megaopd.trainer.roles import load_role_model

    pgs = initialize_actor_layout(Layout(tp, pp, ep))
    actor = load_role_model(ModelConfig(path=hf_dir, tp=tp, pp=pp, ep=ep), pgs, trainable=False)
    gen = torch.Generator().manual_seed(7)
    weights = HFWeights(hf_dir)
    perturbed = {n: weights[n] + 0.05 * torch.randn(weights[n].shape, generator=gen) for n in sorted(weights.keys())}
    st = StageInfo.of(pgs)
    place = Placement(
        tp_rank=st.tp_rank,
        tp_size=tp,
        pp_rank=st.pp_rank,
        pp_size=pp,
        ep_rank=pgs.ep.rank() if ep > 1 else 0,
        ep_size=ep,
    )
    load_hf_weights(actor.model, perturbed, actor.hf, place)
    gathered = list(gather_hf_weights(model_state(actor.model), actor.hf, pgs.tp, pgs.pp, ep_group=expert_group(pgs)))
    mismatches = [n for n, t in gathered if not torch.equal(t, perturbed[n])]
    names_ok = sorted(n for n, _ in gathered) == sorted(perturbed) and len(gathered) == len(perturbed)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, (mismatches, names_ok))

    engine = EmbeddedEngine(EmbeddedEngineConfig(hf_dir=hf_dir, load_tokenizer=False)) if rank == 0 else None
    sync = WeightSync(engine, RolloutConfig(engine="embedded"), rank)
    sync.push(actor.model, actor.hf, pgs, weight_version="moe")
    sync.close()
    if rank != 0:
        return None
    save_hf_dir(out_dir, sorted(perturbed.items()), side_files_from=hf_dir)
    return {
        "mismatches": sorted({n for m, _ in everyone for n in m}),
        "names_ok": all(ok for _, ok in everyone),
        "perturbed_dir": out_dir,
        "engine_lp": engine.prompt_logprobs(PROBE[0])[1:],
        "weight_version": engine.weight_version,
    }


def lora_actor_to_embedded(rank, world_size, hf_dir, tp, lora_sync):
    """A LoRA student at TP=tp (student.lora on all linears) syncs twice into an embedded engine built from hf_dir,
    its adapters set to seeded random values before each push (the same model at any TP), with
    rollout.lora_sync=lora_sync. Returns on rank 0, per push: max |engine - actor| log-prob over PROBE, the
    bytes sent and the adapter's share; and the bytes a LoRA-less full sync of the same model sends."""
    import zlib

    from megaopd.batching.micro_batches import ScoringBatches
    from megaopd.engine.config import EmbeddedEngineConfig
    from megaopd.models.config import LoRAConfig, StudentConfig
    from megaopd.models.lora import adapters
    from megaopd.parallel.groups import Layout, initialize_actor_layout
    from megaopd.rollout.config import RolloutConfig
    from megaopd.rollout.embedded import EmbeddedEngine
    from megaopd.scoring.passes import ScoreRequest, score_tokens
    from megaopd.scoring.runner import PipelineRunner
    from megaopd.sync import WeightSync
    from megaopd.trainer.roles import load_role_model

    pgs = initialize_actor_layout(Layout(tp))
    lora = LoRAConfig(enabled=True, rank=4, alpha=8.0, targets=["all"])
    actor = load_role_model(StudentConfig(path=hf_dir, tp=tp, lora=lora), pgs, trainable=True, seed=3)
    engine = (
        EmbeddedEngine(EmbeddedEngineConfig(hf_dir=hf_dir, max_batch_size=4, load_tokenizer=False))
        if rank == 0
        else None
    )
    rollout = RolloutConfig(lora_sync=lora_sync)
    sync = WeightSync(engine, rollout, rank)
    S = max(len(p) for p in PROBE)
    tokens = torch.zeros(len(PROBE), S, dtype=torch.long)
    for b, p in enumerate(PROBE):
        tokens[b, : len(p)] = torch.tensor(p)

    def randomize(seed):
        """Full A and B drawn by the layer's name, then this rank's TP slice (as models/lora.py shards them)."""
        tp_rank = pgs.tp.rank()
        for name, a in adapters(actor.model):
            gen = torch.Generator().manual_seed(seed + zlib.crc32(name.encode()))
            for p, split in ((a.lora_A, 1 if a.kind == "row" else None), (a.lora_B, 0 if a.kind == "column" else None)):
                full_shape = list(p.shape)
                if split is not None:
                    full_shape[split] *= tp
                full = torch.randn(full_shape, generator=gen) * 0.2
                with torch.no_grad():
                    p.copy_(full if split is None else full.chunk(tp, dim=split)[tp_rank])

    pushes = []
    for version, seed in enumerate((11, 12), start=1):
        randomize(seed)
        stats = sync.push(actor.model, actor.hf, pgs, weight_version=str(version))
        actor_lp = score_tokens(
            PipelineRunner(actor.model, pgs, actor.hf.vocab_size), tokens, ScoringBatches(2), ScoreRequest(1.0)
        ).logprobs_BT
        if rank == 0:
            engine_lp = [engine.prompt_logprobs(p)[1:] for p in PROBE]
            gap = max(abs(e - a) for b, lp in enumerate(engine_lp) for e, a in zip(lp, actor_lp[b, : len(lp)].tolist()))
            pushes.append(
                dict(gap=gap, bytes=stats.bytes, adapter_bytes=stats.adapter_bytes, version=engine.weight_version)
            )
    sync.close()
    return pushes if rank == 0 else None

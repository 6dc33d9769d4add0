"""Spawned worker of tests/scoring/test_owners.py: scores routed to the rows' owners vs HF float64."""

from __future__ import annotations

import torch

LENGTHS = [19, 4, 11, 7, 16, 3, 9]  # real tokens per row: very uneven
OWNER = [1, 0, 0, 1, 1, 0, 1]  # actor DP rank that trains each row (non-contiguous on purpose)
TOPK = 4


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    tokens = torch.zeros(len(LENGTHS), max(LENGTHS), dtype=torch.long)
    for b, n in enumerate(LENGTHS):
        tokens[b, :n] = torch.randint(3, vocab, (n,), generator=gen)
    return tokens, torch.tensor(LENGTHS)


def hf_reference(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """Float64 log-softmax of the HF model at every position [B, T, V] (right padding: causal attention keeps
    real positions exact)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float64)
    with torch.no_grad():
        return model(tokens).logits[:, :-1].log_softmax(-1)


def owned_scores(rank, world_size, student_dir, teacher_dir, actor_tp, teacher_layouts, pack):
    """Actor at TP=actor_tp (DP = world / TP), teachers at each (tp, pp) of teacher_layouts; every pass with
    owners OWNER. Per rank: the rows held, the shapes held, and max |error| against HF float64 of each
    pass on the real positions (and exact zeros past them); the teacher also at the actor's top-k ids."""
    from megaopd.batching.micro_batches import ScoringBatches
    from megaopd.batching.owners import RowOwners
    from megaopd.models.config import ModelConfig
    from megaopd.parallel.groups import Layout, build_process_groups, initialize_actor_layout
    from megaopd.scoring.passes import ScoreRequest, score_tokens
    from megaopd.scoring.runner import PipelineRunner
    from megaopd.trainer.roles import load_role_model

    pgs = initialize_actor_layout(Layout(actor_tp, 1))
    actor = load_role_model(ModelConfig(path=student_dir, tp=actor_tp), pgs, trainable=False)
    V = actor.hf.vocab_size
    tokens, lengths = batch(V)
    T = tokens.shape[1] - 1
    dp = pgs.dp.size()
    owners = RowOwners(tuple(o % dp for o in OWNER), pgs.dp.rank(), dp, pgs.tp.rank() == 0 and pgs.pp.rank() == 0)
    mine = owners.rows()
    valid = torch.arange(T).unsqueeze(0) < (lengths[mine] - 1).unsqueeze(1)
    batches = ScoringBatches(2, 24 if pack else None, lengths)
    request = ScoreRequest(1.0, topk=TOPK, entropy=True)

    def errors(scores, ref_BTV, at_ids=None):
        ref = ref_BTV[mine]
        out = {
            "rows": scores.rows,
            "shapes": {
                k: tuple(getattr(scores, k).shape)
                for k in ("logprobs_BT", "entropy_BT", "topk_ids_BTK", "topk_logprobs_BTK")
            },
            "ids_dtype": str(scores.topk_ids_BTK.dtype),
        }
        lp = ref.gather(-1, tokens[mine, 1:].unsqueeze(-1)).squeeze(-1)
        out["logprobs"] = float((scores.logprobs_BT.double() - lp)[valid].abs().max())
        ent = -(ref.exp() * ref).sum(-1)
        out["entropy"] = float((scores.entropy_BT.double() - ent)[valid].abs().max())
        top_lp, top_ids = ref.topk(TOPK, -1)
        out["topk_ids_equal"] = bool(torch.equal(scores.topk_ids_BTK.long()[valid], top_ids[valid]))
        out["topk_logprobs"] = float((scores.topk_logprobs_BTK.double() - top_lp)[valid].abs().max())
        out["zeros_past_length"] = bool((scores.logprobs_BT[~valid] == 0).all())
        if at_ids is not None:
            at = ref.gather(-1, at_ids.long())
            out["at_ids"] = float((scores.at_ids_logprobs_BTK.double() - at)[valid].abs().max())
        return out

    res = {"dp_rank": pgs.dp.rank(), "mine": mine}
    a = score_tokens(PipelineRunner(actor.model, pgs, V), tokens, batches, request, owners=owners)
    res["actor"] = errors(a, hf_reference(student_dir, tokens))
    t_ref = hf_reference(teacher_dir, tokens)
    for tp, pp in teacher_layouts:
        tpgs = pgs if (tp, pp) == (actor_tp, 1) else build_process_groups(Layout(tp, pp))
        teacher = load_role_model(ModelConfig(path=teacher_dir, tp=tp, pp=pp), tpgs, trainable=False)
        t = score_tokens(
            PipelineRunner(teacher.model, tpgs, V), tokens, batches, request, at_ids_BTK=a.topk_ids_BTK, owners=owners
        )
        res[f"teacher_tp{tp}_pp{pp}"] = errors(t, t_ref, a.topk_ids_BTK)
    # No owners (`megaopd logprobs`, the parity probe): every rank gets every row.
    everyone = score_tokens(PipelineRunner(teacher.model, tpgs, V), tokens, batches, ScoreRequest(1.0))
    lp = t_ref.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    all_valid = torch.arange(T).unsqueeze(0) < (lengths - 1).unsqueeze(1)
    res["everyone"] = {
        "rows": everyone.rows,
        "logprobs": float((everyone.logprobs_BT.double() - lp)[all_valid].abs().max()),
    }
    return res

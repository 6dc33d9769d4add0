"""megaopd.scoring: running Megatron models over token sequences (after rollout, before the loss).

    runner = PipelineRunner(model, pg_collection, vocab_size, partner=None)   # the one pipeline runner
    scores = score_tokens(runner, tokens_BS, ScoringBatches(micro_batch_size), ScoreRequest(temperature, topk=32))
    report = parity_report(engine_logprobs, actor_logprobs)                    # the weight-sync probe

Modules: runner (megatron's schedule over micro-batches at any TP/PP, with a lockstep partner; the one
place micro-batches move to the device), passes (log-probs of given tokens, top-k, entropy, log-probs at
given ids: the actor's log pi_old, the teacher's log q, `megaopd logprobs`), routing (which replica scores
which rows, and the scores' trip to the rows' owners), exchange (the all_to_all of rows), config (the
teacher section), parity (engine vs actor
statistics and their bounds in float32 and bf16), cli (`megaopd logprobs`), remote (a teacher served by
SGLang / `megaopd serve`: prefill scoring over several servers with retries), scorers (the one Scorer
protocol the actor's pass, in-job and served teachers implement: a part of the rollout as it arrives, then
the whole batch), teachers (the job's teachers, in-job or served, and the routing of each sample to its
teacher). The training step runs its
micro-batches through the same runner (megaopd.trainer).
"""

from megaopd.scoring.parity import ParityBounds, ParityReport, bounds_for, check_engine_parity, parity_report

# The runner and the passes import megatron (seconds, and its warnings): loaded on first use, so that
# `megaopd logprobs` can refuse a bad input before paying for it.
_LAZY = {
    "PipelineRunner": "megaopd.scoring.runner",
    "score_sequences": "megaopd.scoring.passes",
    "score_tokens": "megaopd.scoring.passes",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'megaopd.scoring' has no attribute {name!r}")


__all__ = [
    "ParityBounds",
    "ParityReport",
    "PipelineRunner",
    "bounds_for",
    "check_engine_parity",
    "parity_report",
    "score_sequences",
    "score_tokens",
]

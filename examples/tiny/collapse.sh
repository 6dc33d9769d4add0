#!/usr/bin/env bash
# The collapse study on the tiny CPU setup (ALGORITHMS.md 3, paper 2604.08527 fig. 2): plain OPD and
# Stable-OPD under a stress setting (4x the demo's learning rate, no gradient clipping, a 384-token budget,
# 16 prompts x 4 per step, 140 steps), same models, data and seed; then one figure of both. About 8-15
# minutes per run.
# NOT REPRODUCED as the paper reports it: both runs show short, self-healing bursts of truncation and
# repetition (up to 0.17), neither a sustained collapse (examples/tiny/README.md).
#   bash examples/tiny/collapse.sh [RUNS_DIR] [key=value ...]     (default RUNS_DIR: runs/tiny/collapse)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-runs/tiny/collapse}
shift || true
STRESS=(optimizer.lr=2.0e-3 optimizer.clip_grad=0 trainer.prompts_per_step=16 rollout.max_new_tokens=384 validation.max_new_tokens=384
        trainer.max_steps=140 trainer.eval_interval=25 trainer.save_interval=100 validation.max_problems=32)
megaopd train examples/tiny/opd.yaml run.dir="$OUT/opd" "${STRESS[@]}" "$@"
megaopd train examples/tiny/stable_opd.yaml run.dir="$OUT/stable_opd" "${STRESS[@]}" "$@"
megaopd plot "$OUT/opd" "$OUT/stable_opd" --out "$OUT/plots"
echo "figures: $OUT/plots/collapse.png $OUT/plots/dynamics.png"

#!/usr/bin/env bash
# The collapse study on the tiny CPU setup (docs/algorithms.md 2.8, paper 2604.08527 fig. 2): plain OPD and
# Stable-OPD under a stress setting (10x the demo's learning rate, no gradient clipping, a 384-token budget,
# 16 prompts x 4 per step, 180 steps), same models, data and seed; then one figure of both. About 15
# minutes in all. Plain OPD collapses into truncated, repeating responses after step 130 (truncation and
# repetition rates -> 0.9); Stable-OPD does not (examples/tiny/README.md, "The collapse study").
#   bash examples/tiny/collapse.sh [RUNS_DIR] [key=value ...]     (default RUNS_DIR: runs/tiny/collapse)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-runs/tiny/collapse}
shift || true
STRESS=(optimizer.lr=5.0e-3 optimizer.clip_grad=0 trainer.prompts_per_step=16 rollout.max_new_tokens=384 validation.max_new_tokens=384
        trainer.max_steps=180 trainer.eval_interval=20 trainer.save_interval=100 validation.max_problems=32)
megaopd train examples/tiny/opd.yaml run.dir="$OUT/opd" "${STRESS[@]}" "$@"
megaopd train examples/tiny/stable_opd.yaml run.dir="$OUT/stable_opd" "${STRESS[@]}" "$@"
megaopd plot "$OUT/opd" "$OUT/stable_opd" --out "$OUT/plots"
echo "figures: $OUT/plots/collapse.png $OUT/plots/dynamics.png"

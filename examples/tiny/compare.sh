#!/usr/bin/env bash
# Plain OPD vs Stable-OPD on the tiny CPU setup, same models, data and seed, then one figure of both:
#   bash examples/tiny/compare.sh [RUNS_DIR] [key=value ...]     (default RUNS_DIR: runs/tiny/compare)
# Extra key=value overrides go to both runs (e.g. trainer.max_steps=20). The two runs take about twice
# the demo's time (examples/tiny/README.md); each resumes if started again.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-runs/tiny/compare}
shift || true
megaopd train examples/tiny/opd.yaml run.dir="$OUT/opd" "$@"
megaopd train examples/tiny/stable_opd.yaml run.dir="$OUT/stable_opd" "$@"
megaopd plot "$OUT/opd" "$OUT/stable_opd" --out "$OUT/plots"
echo "figures: $OUT/plots/collapse.png $OUT/plots/dynamics.png"

#!/usr/bin/env bash
# The real-model example end to end (examples/real/README.md): the models, `megaopd eval` of teacher and
# student (number and boxed extraction), golden NLL before, the three arms one after another (each measured:
# wall time, peak memory of its process tree), then golden NLL and `megaopd eval` (number) of each arm's final
# student, then the table and figure. The arms run with trainer.eval_interval=0: their accuracy before and
# after is `megaopd eval` of the student and of RUN/hf with the presets' validation settings (the same prompts,
# greedy, 128 new tokens, all 60 problems), which spares three identical step-0 validations.
#
#   bash examples/real/run_all.sh              # everything into runs/real/ (about 1-2 hours on a busy 2-core CPU)
#   ARMS="sft" bash examples/real/run_all.sh   # some arms only; SKIP_EVAL=1 skips the four evals
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/real}
ARMS=${ARMS:-"stable_opd opd sft"}
mkdir -p "$OUT"
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
student=$(PYTHON=$PY bash scripts/install_smollm2.sh --student | tail -n 1)
teacher=$(PYTHON=$PY bash scripts/install_smollm2.sh --path | tail -n 1)
# The evals use the validation's settings: greedy, 128 new tokens, all 60 problems.
evaluate() {  # label model extract
  "$PY" -m megaopd.cli eval --ckpt "$2" --benchmarks examples/real/data/val.jsonl --samples 1 --temperature 0 \
      --max-new-tokens 128 --extract "$3" --label "$1" --out "$OUT/eval_$1_$3" 2>&1 | grep -v "Loading weights"
}
if [ -z "${SKIP_EVAL:-}" ]; then
  for who in teacher student; do
    model=$teacher; [ $who = student ] && model=$student
    for extract in number boxed; do evaluate $who "$model" $extract; done
  done
fi
"$PY" examples/real/golden_nll.py "$teacher" "$student" --json "$OUT/nll_before.json"
for arm in $ARMS; do
  rm -rf "$OUT/$arm"
  "$PY" examples/real/measure.py --out "$OUT/measure_$arm.json" -- \
      "$PY" -m megaopd.cli train examples/real/$arm.yaml run.dir="$OUT/$arm" trainer.eval_interval=0 > "$OUT/$arm.log" 2>&1
  "$PY" examples/real/golden_nll.py "$OUT/$arm/hf" --json "$OUT/nll_after_$arm.json"
done
for arm in $ARMS; do evaluate "$arm" "$OUT/$arm/hf" number; done
"$PY" examples/real/report.py --runs "$OUT"

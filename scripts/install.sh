#!/usr/bin/env bash
# Installs megaopd and what it needs into the current Python, without ever pulling a CUDA torch:
# torch is installed first (pinned; on CPU machines the local CPU wheel), then everything else is
# resolved under a constraint that keeps that torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${MEGAOPD_TORCH_VERSION:-2.13.0}
if ! $PY -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
  $PY -m pip install -q "torch==$TORCH_VERSION"
fi
constraint=$(mktemp)
$PY -c "import torch; print('torch==' + torch.__version__)" > "$constraint"
$PY -m pip install -q -c "$constraint" -e ".[dev]"
rm -f "$constraint"

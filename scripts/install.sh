#!/usr/bin/env bash
# Installs megaopd (editable) and what it needs into one Python environment, and says what it did.
#
#   bash scripts/install.sh                  # into ./.venv (made here, Python 3.10+), the Makefile's default
#   PYTHON=python3 bash scripts/install.sh   # into that interpreter's environment instead (make ... PYTHON=python3)
#
# torch: an installed torch (any version, CPU or CUDA, seen by that Python) is kept as it is. Where
# none is installed, MEGAOPD_TORCH chooses the build of torch ${MEGAOPD_TORCH_VERSION:-2.13.0}:
#   cpu  (default)  the CPU build. Taken from pip's configured sources when they hold one (a local
#                   wheel, a mirror); where they would give a CUDA build (PyPI's Linux wheels are CUDA
#                   builds with several GB of nvidia-* packages), from PyTorch's CPU wheel index instead
#                   (TORCH_INDEX_URL, default below). Nothing CUDA is ever downloaded in this mode: if
#                   neither source has a CPU build, the script stops and says what to do.
#   cuda            PyPI's default build (CUDA on Linux), or TORCH_INDEX_URL's (e.g. a cuXXX index).
# Everything else is resolved under a constraint that keeps that torch, so no dependency replaces it.
# triton: an installed one is kept (CUDA builds of torch bring their own); otherwise triton==${MEGAOPD_TRITON_VERSION:-3.7.1}
# (no dependencies, so it cannot pull a torch): megaopd.ops' kernels on GPUs, its interpreter in the CPU tests.
# Runs again in about a second when nothing changed (a stamp keyed by setup.py and this script).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
TORCH_VERSION=${MEGAOPD_TORCH_VERSION:-2.13.0}
TRITON_VERSION=${MEGAOPD_TRITON_VERSION:-3.7.1}
TORCH_BUILD=${MEGAOPD_TORCH:-cpu}
CPU_INDEX=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
say() { echo "[install] $*"; }
die() { echo "[install] error: $*" >&2; exit 1; }
case $TORCH_BUILD in cpu|cuda) ;; *) die "MEGAOPD_TORCH=$TORCH_BUILD: use cpu or cuda" ;; esac

PY=${PYTHON:-.venv/bin/python}
if [ "$PY" = .venv/bin/python ] || [ "$PY" = "$repo/.venv/bin/python" ]; then
  PY=$repo/.venv/bin/python
  if [ ! -x "$PY" ]; then
    command -v python3 >/dev/null || die "python3 not found: install Python 3.10+ (or pass PYTHON=...)"
    python3 -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "python3 is $(python3 -V 2>&1); megaopd needs 3.10+"
    say "making the virtual environment .venv (with the system's site-packages visible, so an installed torch is kept)"
    python3 -m venv --system-site-packages .venv
  fi
fi
# Checks run from / and without PYTHONPATH (test runners set it to the repository) so that the repository's
# own megaopd/ and megaopd.egg-info/ folders are never what gets found: only what is installed.
in_env() { (cd / && env -u PYTHONPATH "$PY" "$@"); }
# pip, minus one warning per package that some machines' pip configs (file:// extra indexes) print
pip_q() { in_env -m pip -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
stamp_dir=$(in_env -c 'import sys; print(sys.prefix)')
stamp=$stamp_dir/.megaopd-install-$(cat setup.py scripts/install.sh | sha256sum | cut -c1-16)
# Up to date: the stamp, and megaopd installed (editable) from this checkout, not from another clone.
installed_here="import importlib.metadata as m, json, sys
sys.exit(json.loads(m.distribution('megaopd').read_text('direct_url.json') or '{}').get('url') != 'file://$repo')"
# megaopd's bytecode, as pip writes it for what it installs into site-packages (not for an editable install):
# where PYTHONDONTWRITEBYTECODE is set, every process would otherwise compile the ~200 modules it imports
# (~0.45 s of each trainer process on a 2-core CPU). Files already compiled are skipped; a stale one is only
# recompiled in memory.
compile_megaopd() { "$PY" -m compileall -q "$repo/megaopd" >/dev/null || say "could not write megaopd's bytecode (it is compiled at import instead)"; }
if [ -f "$stamp" ] && in_env -c "$installed_here" 2>/dev/null && [ -x "$(dirname "$PY")/megaopd" ]; then
  compile_megaopd
  say "up to date in $stamp_dir ($(cat "$stamp"))"
  exit 0
fi

torch_desc() { in_env -c 'import torch; print("torch", torch.__version__, "(CUDA " + torch.version.cuda + ")" if torch.version.cuda else "(CPU build)")'; }
if in_env -c 'import torch' 2>/dev/null; then
  say "keeping the installed $(torch_desc)"
elif [ "$TORCH_BUILD" = cuda ]; then
  say "installing torch==$TORCH_VERSION, CUDA build${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL} (several GB)"
  pip_q install "torch==$TORCH_VERSION" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
else
  # What would pip's configured sources give? --dry-run reads metadata only: nothing is downloaded.
  report=$(mktemp)
  pip_q install --dry-run --ignore-installed --report "$report" "torch==$TORCH_VERSION" >/dev/null
  if in_env -c "import json,sys; r=json.load(open('$report')); sys.exit(any(i['metadata']['name'].startswith('nvidia-') for i in r['install']))"; then
    say "installing torch==$TORCH_VERSION, CPU build, from pip's configured sources"
    pip_q install "torch==$TORCH_VERSION"
  else
    say "pip's configured sources have only a CUDA build of torch==$TORCH_VERSION: trying PyTorch's CPU index $CPU_INDEX"
    pip_q install --timeout 30 --retries 1 "torch==$TORCH_VERSION" --index-url "$CPU_INDEX" || die \
      "no CPU build of torch==$TORCH_VERSION could be installed. Either install a torch yourself first (it is kept), \
set TORCH_INDEX_URL to a reachable CPU wheel index, or accept the CUDA build with MEGAOPD_TORCH=cuda."
  fi
  rm -f "$report"
fi
torch_now=$(torch_desc)
constraint=$(mktemp)
in_env -c "import torch; print('torch==' + torch.__version__)" > "$constraint"
say "installing megaopd (editable) and its dependencies, torch held at $(cat "$constraint")"
pip_q install -c "$constraint" -e "$repo[dev]"
if in_env -c 'import triton' 2>/dev/null; then
  say "keeping the installed triton $(in_env -c 'import triton; print(triton.__version__)')"
elif pip_q install -c "$constraint" "triton==$TRITON_VERSION"; then
  say "installed triton==$TRITON_VERSION (megaopd.ops' Triton kernels; the CPU tests run them through its interpreter)"
else
  say "no triton==$TRITON_VERSION for this platform (wheels: Linux): the ops use their torch path, tests/ops/test_triton.py skips"
fi
compile_megaopd
rm -f "$constraint" "$stamp_dir"/.megaopd-install-*
echo "$torch_now" > "$stamp"
say "done: megaopd in $stamp_dir with $torch_now"

#!/usr/bin/env bash
# Installs SGLang 0.5.23's own server for the CPU test tier (tests/e2e/sglang) into a venv of its own, and
# prints that venv's path as the last line of its output.
#
#   bash scripts/install_sglang.sh           # install (about 5 minutes and 3 GB cold), or reuse the cache
#   bash scripts/install_sglang.sh --path    # only print where the venv is (or would be); installs nothing
#
# The venv lives in ${MEGAOPD_CACHE:-~/.cache/megaopd}/sglang-0.5.23-<key>, the key a hash of the pins
# (this script's versions and scripts/sglang_cpu_requirements.txt): a pin change makes a new venv, an
# unchanged one is reused in about a second. A venv is complete only once it imported SGLang's server
# (a stamp file); an interrupted install is removed and redone. Concurrent runs wait for each other.
#
# What goes in, all with --no-deps (SGLang's metadata pins torch 2.14.1 and CUDA packages; pip must never
# resolve them): torch 2.13.0, CPU build (pip's configured sources when they hold it, else PyTorch's CPU
# index, TORCH_INDEX_URL); the pinned pure-Python requirements; sglang==0.5.23. Not installed: sgl_kernel
# (its CPU build is not on PyPI) and torchvision (the PyPI wheel is a CUDA build): import-only stand-ins
# in tests/e2e/sglang/stubs go on the server's PYTHONPATH instead (tests/e2e/sglang/servers.py runs it).
set -euo pipefail
cd "$(dirname "$0")/.."
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0
REQS=scripts/sglang_cpu_requirements.txt
CPU_INDEX=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
say() { echo "[install_sglang] $*" >&2; }
die() { echo "[install_sglang] error: $*" >&2; exit 1; }

key=$( { echo "sglang==$SGLANG_VERSION torch==$TORCH_VERSION+cpu"; grep -v '^#' "$REQS"; } | sha256sum | cut -c1-12)
cache=${MEGAOPD_CACHE:-$HOME/.cache/megaopd}
venv=$cache/sglang-$SGLANG_VERSION-$key
stamp=$venv/.megaopd-complete
if [ "${1:-}" = --path ]; then echo "$venv"; exit 0; fi
[ $# -eq 0 ] || die "unknown argument $1 (use --path or nothing)"

mkdir -p "$cache"
exec 9>"$venv.lock"
flock 9  # another test session may be installing the same venv: wait for it, then reuse it
if [ -f "$stamp" ]; then
  say "cached: $venv ($(cat "$stamp"))"
  echo "$venv"
  exit 0
fi
command -v python3 >/dev/null || die "python3 not found (SGLang 0.5.23 needs Python 3.10+)"
t0=$SECONDS
rm -rf "$venv"
say "making $venv"
python3 -m venv "$venv"
PY=$venv/bin/python
# pip, minus one warning per package that some machines' pip configs (file:// extra indexes) print
pip_q() { "$PY" -m pip -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }

say "torch==$TORCH_VERSION, CPU build"
if ! pip_q install --no-deps "torch==$TORCH_VERSION+cpu" 2>/dev/null; then
  say "pip's configured sources have no CPU build: trying PyTorch's CPU index $CPU_INDEX"
  pip_q install --no-deps --timeout 30 --retries 1 --index-url "$CPU_INDEX" "torch==$TORCH_VERSION+cpu" \
    || die "no CPU build of torch==$TORCH_VERSION could be installed; set TORCH_INDEX_URL to a reachable CPU wheel index"
fi
say "SGLang's requirements, pinned ($(grep -cv '^#' "$REQS") packages from $REQS)"
pip_q install --no-deps -r "$REQS"
say "sglang==$SGLANG_VERSION"
pip_q install --no-deps "sglang==$SGLANG_VERSION"
# The check that matters: the server's modules import with the stand-ins, as tests/e2e/sglang starts them.
stubs=$(pwd)/tests/e2e/sglang/stubs
check=$(mktemp)
(cd / && SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$stubs" "$PY" -c "import sglang.launch_server, sglang.srt.entrypoints.http_server" \
  >"$check" 2>&1) || { cat "$check" >&2; die "SGLang's server does not import in $venv (above); the venv is left for inspection"; }
rm -f "$check"
"$PY" -c "import torch, sglang; print(f'sglang {sglang.__version__}, torch {torch.__version__}')" > "$stamp"
say "done in $((SECONDS - t0)) s: $(cat "$stamp"), $(du -sh "$venv" | cut -f1)"
echo "$venv"

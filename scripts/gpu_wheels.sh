#!/usr/bin/env bash
# Downloads, into .whl/ at the repository root, the Python 3.12 x86-64 wheels that megaopd needs and the GPU
# machine's image lacks (it has torch, transformers, safetensors, tokenizers, numpy, sympy, psutil, einops,
# pyyaml, tqdm, matplotlib, tensorboard; it has no network). Run it here (where pip reaches PyPI), then carry
# .whl to the GPU machine; scripts/gpu_check.sh's header gives the exact call and the install line.
#
#   bash scripts/gpu_wheels.sh        # about 10 MB; .whl/ is git-ignored
#
# Not carried: SGLang and Transformer Engine (their CUDA kernels are far over the 64 MiB a call may carry);
# `datasets` (megaopd imports it only for parquet/HF-hub data; the check reads jsonl).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=.whl
mkdir -p "$DEST"

# One version of each: two versions of one package stop the whole `pip install --no-deps` there.
#  - megatron-core 0.16.1: the version megaopd/models/compat.py is written against.
#  - omegaconf 2.4.0 declares antlr4-python3-runtime>=4.9 (2.3 pinned 4.9.*), so one antlr4, 4.13.2,
#    serves both it and math-verify's latex parser (math-verify[antlr4_13_2]).
PACKAGES=(
  megatron-core==0.16.1
  omegaconf==2.4.0
  antlr4-python3-runtime==4.13.2
  math-verify==0.9.0
  latex2sympy2_extended==1.11.0
)

platforms=()
for p in manylinux_2_39_x86_64 manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done

for spec in "${PACKAGES[@]}"; do
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${platforms[@]}" -d "$DEST" "$spec"
done

# What the wheels need beyond each other (extras skipped): check by eye against the image's package list
# (/work/.library/device/KINDS.md, "Python packages already there").
for w in "$DEST"/*.whl; do
  echo "== $(basename "$w")"
  unzip -p "$w" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' || true
done
du -sh "$DEST"

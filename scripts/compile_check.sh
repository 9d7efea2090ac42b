#!/usr/bin/env bash
# Compiles single kernel files against the stable ABI only, without linking (a quick
# check while porting): bash scripts/compile_check.sh csrc/cpu/unique_cpu.cpp csrc/cuda/unique_cuda.cu
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
TORCH_INC="$("$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))')"
PY_INC="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
TARGET="-DTORCH_TARGET_VERSION=0x020a000000000000"
for src in "$@"; do
  case "$src" in
    *.cu) "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" -std=c++20 -O3 --expt-relaxed-constexpr -DSPARSEKIT_CUDA $TARGET \
            -gencode arch=compute_90,code=sm_90 -Xcompiler -fPIC -I"$ROOT/csrc" -I"$TORCH_INC" \
            -c "$src" -o /tmp/compile_check_$$.o ;;
    *) c++ -std=c++20 -O3 -Wall -fPIC $TARGET -I"$ROOT/csrc" -I"$TORCH_INC" -I"$PY_INC" -fsyntax-only "$src" ;;
  esac
  echo "ok: $src"
done

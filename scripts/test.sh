#!/usr/bin/env bash
# Sets up a virtual environment, builds sparsekit and runs its C++ and Python tests.
#
#   bash scripts/test.sh [pytest args...]
#
# .venv/ (created when missing) gets the CUDA build of torch 2.13.0, which runs on
# machines with or without a GPU. The extension is built with its CUDA kernels when nvcc
# is found (CUDA_HOME, PATH or /usr/local/cuda); SPARSEKIT_CUDA=0/1 forces either way.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${SPARSEKIT_VENV:-.venv}
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
# --isolated: the registry's CUDA build of torch, not a local CPU-only file.
"$PY" -m pip install --isolated -q --upgrade pip
"$PY" -m pip install --isolated -q "torch==2.13.0" numpy pytest expecttest tqdm xxhash ninja setuptools wheel cmake

echo "== building sparsekit (SPARSEKIT_CUDA=${SPARSEKIT_CUDA:-auto})"
"$PY" -m pip install --isolated -q --no-build-isolation --no-deps -e .
"$PY" - <<'PY'
import torch, sparsekit
cuda = torch._C._dispatch_has_kernel_for_dispatch_key("sparsekit::unique", "CUDA")
print(f"sparsekit {sparsekit.__version__} on torch {torch.__version__}: CUDA kernels {'compiled' if cuda else 'not compiled'}, "
      f"GPU {'present' if torch.cuda.is_available() else 'absent'}")
PY

echo "== C++ tests (CMake + ctest)"
"$VENV/bin/cmake" -S . -B build/cmake -DPython3_EXECUTABLE="$(cd "$(dirname "$PY")" && pwd)/python" > build-cmake.log 2>&1 \
  || { cat build-cmake.log; exit 1; }
"$VENV/bin/cmake" --build build/cmake -j "${MAX_JOBS:-2}" >> build-cmake.log 2>&1 || { cat build-cmake.log; exit 1; }
"$VENV/bin/ctest" --test-dir build/cmake --output-on-failure

echo "== Python tests"
set +e
"$PY" -m pytest -q "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$status"

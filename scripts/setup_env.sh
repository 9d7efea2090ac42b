# Sourced by scripts/test.sh and scripts/train.sh: makes .venv/ (or $SPARSEKIT_VENV) with
# the CUDA build of torch 2.13.0 and builds sparsekit into it (editable), with the CUDA
# kernels when nvcc is found; SPARSEKIT_CUDA=0/1 forces either way. Sets $PY.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=${SPARSEKIT_VENV:-.venv}
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"
# --isolated: the registry's CUDA build of torch, not a local CPU-only file.
"$PY" -m pip install --isolated -q --upgrade pip
"$PY" -m pip install --isolated -q "torch==2.13.0" numpy pytest hypothesis expecttest tqdm xxhash ninja setuptools wheel cmake

echo "== building sparsekit (SPARSEKIT_CUDA=${SPARSEKIT_CUDA:-auto})"
"$PY" -m pip install --isolated -q --no-build-isolation --no-deps -e .
"$PY" - <<'PY'
import torch, sparsekit
cuda = torch._C._dispatch_has_kernel_for_dispatch_key("sparsekit::unique", "CUDA")
print(f"sparsekit {sparsekit.__version__} on torch {torch.__version__}: CUDA kernels "
      f"{'compiled' if cuda else 'not compiled'}, GPU {'present' if torch.cuda.is_available() else 'absent'}")
PY

# Sourced by scripts/test.sh and scripts/train.sh: makes .venv/ (or $SPARSEKIT_VENV) with
# the CUDA build of torch 2.13.0, builds sparsekit in place (incrementally) and puts the
# source tree on the venv's path, with the CUDA kernels when a CUDA toolkit is found;
# SPARSEKIT_CUDA=0/1 forces either way. Sets $PY.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

VENV=${SPARSEKIT_VENV:-.venv}
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  echo "== creating $VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
  "$PY" -m pip install --isolated -q --upgrade pip
fi
# --isolated: the registry's CUDA build of torch, not a local CPU-only file. The first run
# downloads torch (~3 GB with its CUDA libraries); later runs skip pip while the list below
# is the one last installed (pip's own check of met requirements takes seconds).
requirements='"torch==2.13.0" numpy pytest hypothesis expecttest tqdm xxhash ninja setuptools wheel cmake'
requirements_stamp="$VENV/.sparsekit-requirements"
if [ ! -f "$requirements_stamp" ] || [ "$(cat "$requirements_stamp")" != "$requirements" ]; then
  eval "\"\$PY\" -m pip install --isolated -q $requirements"
  echo "$requirements" > "$requirements_stamp"
fi

# The source tree is the package: a .pth file puts it on the venv's path (what an editable
# install does, without its rebuild in a fresh temporary directory on every run).
site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$(pwd)" > "$site/sparsekit-source.pth"

# Build in place; object files persist under build/, so ninja recompiles only what changed,
# and nothing runs when the library is newer than every source and was built the same way.
lib=$(ls sparsekit/_C*.so 2>/dev/null | head -n 1 || true)
# torch's version (with its +cuXYZ) from torch/version.py alone: importing torch here
# would cost seconds on every call.
want="torch=$("$PY" -c 'import importlib.util, os, runpy
spec = importlib.util.find_spec("torch")
print(runpy.run_path(os.path.join(spec.submodule_search_locations[0], "version.py"))["__version__"])') cuda=${SPARSEKIT_CUDA:-auto} home=${CUDA_HOME:-}"
stamp=build/sparsekit-build-stamp
if [ -n "$lib" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -f sparsekit/_build_info.py ] \
    && [ -z "$(find csrc setup.py -newer "$lib" -print -quit)" ]; then
  echo "== sparsekit is up to date ($lib)"
else
  echo "== building sparsekit (SPARSEKIT_CUDA=${SPARSEKIT_CUDA:-auto}; a full CUDA build takes ~8 min on 2 cores, a CPU-only one ~2 min; only changed files are recompiled)"
  if [ -z "${SPARSEKIT_CUDA:-}" ] && [ -n "${CUDA_HOME:-}" ] && ! command -v nvidia-smi > /dev/null; then
    echo "   (no GPU here: SPARSEKIT_CUDA=0 before the command builds the CPU kernels only, in a quarter of the time)"
  fi
  mkdir -p build
  start=$SECONDS
  # The objects of this build in a folder of their own per flavour: a `pip install .` (which
  # builds under build/ too) cannot overwrite what the incremental build relies on.
  temp="build/dev-cuda-${SPARSEKIT_CUDA:-auto}"
  # One line per compiled file as ninja goes ([done/total] file); the whole log is in
  # build/build.log.
  if ! "$PY" setup.py build_ext --inplace --build-temp "$temp" 2>&1 | tee build/build.log \
      | sed -unE 's/^\[([0-9]+\/[0-9]+)\] .* -c (-c )?([^ ]+\.(cpp|cu)) .*/   [\1] \3/p'; then
    cat build/build.log
    exit 1
  fi
  echo "$want" > "$stamp"
  echo "   built in $((SECONDS - start)) s"
  # What was just built, loaded once (a call that builds nothing skips this import).
  "$PY" - <<'PY'
import torch, sparsekit
cuda = torch._C._dispatch_has_kernel_for_dispatch_key("sparsekit::unique", "CUDA")
print(f"sparsekit {sparsekit.__version__} on torch {torch.__version__}: CUDA kernels "
      f"{'compiled' if cuda else 'not compiled'}, GPU {'present' if torch.cuda.is_available() else 'absent'}")
PY
fi

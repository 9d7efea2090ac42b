#!/usr/bin/env bash
# Installs one built sparsekit wheel into a fresh virtual environment holding another
# torch, without rebuilding it, and runs the op tests and the peers' ported suites there
# against the installed copy:
# the proof that one wheel serves every torch from its stable-ABI target on.
#
#   bash scripts/check_wheel.sh WHEEL TORCH_VERSION [VENV_DIR]
#
# The wheel is installed with its dependencies resolved by pip against the torch already
# there, so a requirement the wheel could not keep fails here too. The venv is removed
# afterwards, also when a step fails, unless KEEP_VENV=1 (a CUDA torch takes ~7 GB).
# SOURCE_BUILD=1 also compiles the sources (CPU kernels) against that torch and runs the op
# tests on that build.
set -euo pipefail
wheel=$(readlink -f "$1")
torch_version=$2
venv=${3:-$(mktemp -d)/venv}
repo="$(cd "$(dirname "$0")/.." && pwd)"
start=$(date +%s)

work=$(mktemp -d)
# Whatever happens (a failed install included), the test copy goes, and the venv too
# unless asked to keep it: a CUDA torch left behind by each failed run fills the disk.
cleanup() {
  rm -rf "$work"
  [ "${KEEP_VENV:-0}" = 1 ] || { rm -rf "$venv"; rmdir "$(dirname "$venv")" 2>/dev/null || true; }
}
trap cleanup EXIT

echo "== wheel $(basename "$wheel") under torch $torch_version"
# pip without this machine's configuration files: some machines cap torch's version in a
# global constraint file (`pip config debug` shows it; one here allows no torch above
# 2.14.1), which would refuse the newer torch this check exists to try.
export PIP_CONFIG_FILE=/dev/null
python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check "torch==$torch_version" pytest hypothesis expecttest
"$venv/bin/pip" install -q --disable-pip-version-check "$wheel"
"$venv/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '$torch_version', torch.__version__"

# Tests only, no source package beside them: `import sparsekit` must find the install.
cp -r "$repo/tests" "$repo/pyproject.toml" "$work/"
cd "$work"
"$venv/bin/python" - <<'PY'
import os, torch, sparsekit
assert "site-packages" in sparsekit.__file__, sparsekit.__file__
print(f"torch {torch.__version__}: sparsekit from {os.path.dirname(sparsekit.__file__)};",
      "unique([3, 1, 3]) =", sparsekit.ops.unique(torch.tensor([3, 1, 3]))[0].tolist())
PY
set +e
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/ops/test_unique.py tests/ops/test_segment.py \
  tests/tables/test_hashtable.py tests/tables/test_hashtable_eviction.py tests/optim/test_lazy_adam.py \
  tests/ops/test_embedding.py tests/ops/test_routing.py tests/ops/test_initializer.py tests/package/test_build.py \
  tests/compile/test_compile.py tests/peers/test_peer_torch.py tests/peers/test_peer_tf_scatter.py \
  tests/peers/test_peer_lazy_adam.py tests/peers/test_peer_fbgemm.py tests/peers/test_peer_hkv.py \
  tests/peers/test_peer_torchrec_optim.py
status=$?
set -e
cd "$repo"
if [ "$status" -eq 0 ] && [ "${SOURCE_BUILD:-0}" = 1 ]; then
  # The sources themselves against this torch's headers (CPU kernels): the headers of the
  # oldest supported torch lack names the newer ones have, which only a build finds.
  echo "== source build under torch $torch_version (CPU kernels)"
  "$venv/bin/pip" install -q --disable-pip-version-check 'setuptools>=77' wheel ninja
  src="$work/source"
  mkdir -p "$src"
  cp -r "$repo/csrc" "$repo/sparsekit" "$repo/tests" "$repo/setup.py" "$repo/pyproject.toml" "$repo/README.md" "$src/"
  rm -f "$src"/sparsekit/_C*.so "$src"/sparsekit/_build_info.py
  (cd "$src" && SPARSEKIT_CUDA=0 MAX_JOBS="${MAX_JOBS:-2}" "$venv/bin/python" setup.py build_ext --inplace \
     > build.log 2>&1) || { tail -60 "$src/build.log"; exit 1; }
  set +e
  (cd "$src" && "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/ops/test_pooled.py tests/ops/test_unique.py \
     tests/ops/test_embedding.py tests/optim/test_lazy_adam.py tests/package/test_build.py)
  status=$?
  set -e
fi
echo "== torch $torch_version: pytest exit $status in $(( $(date +%s) - start )) s"
[ "$status" -eq 5 ] && { echo "pytest collected no tests" >&2; exit 1; }
exit "$status"

#!/usr/bin/env bash
# Runs the TorchRec interop tests against TorchRec itself: a venv layered over an existing
# one (its torch and the sparsekit built there, seen through a .pth file) gets torchrec and
# FBGEMM's CPU build, the pair released for that torch, and the tests that import torchrec
# run there instead of skipping.
#
#   bash scripts/check_torchrec.sh BASE_PYTHON [WORK_DIR]
#
# torchrec requires fbgemm-gpu (the CUDA package); fbgemm-gpu-cpu provides the same module,
# so both are installed without their dependencies and torchrec's others are added.
set -euo pipefail
base_python=$1
work=${2:-$(mktemp -d)}
repo="$(cd "$(dirname "$0")/.." && pwd)"
start=$(date +%s)

torch_version=$("$base_python" -c 'import torch; print(torch.__version__.split("+")[0])')
# The FBGEMM / TorchRec release built against each torch (their native ops are not
# stable-ABI: another torch fails to load them).
case "$torch_version" in
  2.13.*) torchrec=1.8.0 fbgemm=1.8.0 ;;
  2.14.*) torchrec=1.9.2 fbgemm=1.9.0 ;;
  *) echo "check_torchrec.sh: no TorchRec release known for torch $torch_version" >&2; exit 1 ;;
esac
echo "== TorchRec $torchrec + fbgemm-gpu-cpu $fbgemm over torch $torch_version"

export PIP_CONFIG_FILE=/dev/null  # see check_wheel.sh: no machine-wide constraint files
venv="$work/torchrec-venv"
python3 -m venv "$venv"
base_site=$("$base_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# After the venv's own packages: torch, sparsekit (its .pth) and pytest come from the base.
echo "$base_site" > "$site/zz-base-venv.pth"
"$venv/bin/pip" install -q --disable-pip-version-check --no-deps "torchrec==$torchrec" "fbgemm-gpu-cpu==$fbgemm"
# torchrec's other requirements (torchmetrics pinned as torchrec pins it).
"$venv/bin/pip" install -q --disable-pip-version-check pyre-extensions tensordict "torchmetrics==1.0.3" 2>&1 \
  | grep -v -e "dependency resolver does not currently" -e "requires fbgemm-gpu, which is not installed" || true
"$venv/bin/python" -c "import torch, torchrec, fbgemm_gpu, sparsekit; print('torch', torch.__version__, 'torchrec', torchrec.__version__)"

cd "$repo"
tests=$(find tests -name 'test_torchrec*.py' -o -name 'test_variable_batch.py' -o -name 'test_peer_torchrec_*.py' | sort)
set +e
PYTHONPATH="$repo/tests:$repo/tests/support${PYTHONPATH:+:$PYTHONPATH}" \
  "$venv/bin/python" -m pytest -q -p no:cacheprovider -rs $tests 2>&1 | tee "$work/torchrec-tests.log"
status=${PIPESTATUS[0]}
set -e
rm -rf "$venv"
# Here torchrec is installed: a test that skipped for want of it did not run what it exists for.
if grep -q "torchrec (and fbgemm-gpu-cpu) not installed" "$work/torchrec-tests.log"; then
  echo "check_torchrec.sh: a TorchRec test skipped although torchrec is installed" >&2
  status=1
fi
echo "== TorchRec interop: pytest exit $status in $(( $(date +%s) - start )) s"
[ "$status" -eq 5 ] && { echo "pytest collected no tests" >&2; exit 1; }
exit "$status"

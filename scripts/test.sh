#!/usr/bin/env bash
# Sets up .venv (see setup_env.sh), builds sparsekit and runs its C++ and Python tests.
#
#   bash scripts/test.sh [--quick] [pytest args...]
#
# --quick: no setup and no build (the library already built is tested as it is), then the
# C++ tests and the quick tier of the Python tests: every test but the slow, property-based
# (hypothesis), multi-process, GPU, peer-suite and heavy ones (markers in pyproject.toml;
# "heavy" is listed in tests/conftest.py). The full run (CI's) has no -m.
# A -m of your own after --quick replaces the quick tier's.
QUICK_MARKERS="not slow and not property and not distributed and not cuda and not peer and not heavy"

quick=0
args=()
for arg in "$@"; do
  if [ "$arg" = --quick ]; then quick=1; else args+=("$arg"); fi
done

if [ "$quick" = 1 ]; then
  set -euo pipefail
  cd "$(dirname "$0")/.."
  VENV=${SPARSEKIT_VENV:-.venv}
  PY="$VENV/bin/python"
  lib=$(ls sparsekit/_C*.so 2>/dev/null | head -n 1 || true)
  if [ ! -x "$PY" ] || [ -z "$lib" ]; then
    echo "--quick tests the library already built; build it first: bash scripts/test.sh" >&2
    exit 1
  fi
  newer=$(find csrc setup.py -newer "$lib" -print -quit)
  [ -n "$newer" ] && echo "== note: $newer is newer than $lib; --quick does not rebuild" >&2
else
  source "$(dirname "$0")/setup_env.sh"
fi

echo "== C++ tests (CMake + ctest, against the library just built)"
# The tests link the library setup_env.sh built: the kernels are not compiled a second time.
lib=$(ls "$(pwd)"/sparsekit/_C*.so | head -n 1)
"$VENV/bin/cmake" -S . -B build/cmake -DPython3_EXECUTABLE="$(cd "$(dirname "$PY")" && pwd)/python" \
  -DSPARSEKIT_LIBRARY="$lib" > build-cmake.log 2>&1 || { cat build-cmake.log; exit 1; }
"$VENV/bin/cmake" --build build/cmake -j "${MAX_JOBS:-2}" >> build-cmake.log 2>&1 || { cat build-cmake.log; exit 1; }
"$VENV/bin/ctest" --test-dir build/cmake --output-on-failure

set +e
if [ "$quick" = 1 ]; then
  echo "== Python tests, quick tier (-m \"$QUICK_MARKERS\")"
  "$PY" -m pytest -q -m "$QUICK_MARKERS" ${args[@]+"${args[@]}"}
else
  echo "== Python tests"
  "$PY" -m pytest -q ${args[@]+"${args[@]}"}
fi
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$status"

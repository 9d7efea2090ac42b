#!/usr/bin/env bash
# Sets up .venv (see setup_env.sh), builds sparsekit and runs its C++ and Python tests.
#
#   bash scripts/test.sh [pytest args...]
source "$(dirname "$0")/setup_env.sh"

echo "== C++ tests (CMake + ctest, against the library just built)"
# The tests link the library setup_env.sh built: the kernels are not compiled a second time.
lib=$(ls "$(pwd)"/sparsekit/_C*.so | head -n 1)
"$VENV/bin/cmake" -S . -B build/cmake -DPython3_EXECUTABLE="$(cd "$(dirname "$PY")" && pwd)/python" \
  -DSPARSEKIT_LIBRARY="$lib" > build-cmake.log 2>&1 || { cat build-cmake.log; exit 1; }
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

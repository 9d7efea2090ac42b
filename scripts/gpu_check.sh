#!/usr/bin/env bash
# The GPU proof: build sparsekit in place against the torch already installed (no venv, no
# downloads; sm_90 only by default, all cores) or load the library carried in, run the
# whole test suite on CUDA (junit XML), compute-sanitizer (memcheck, racecheck, synccheck,
# initcheck) over sparsekit's own kernels in tests/cuda/test_cuda_smoke.py (every kernel of every
# csrc/cuda/*.cu file, small inputs), then every benchmark with --device cuda (JSON). Every
# stage is time-boxed and the run goes on after a failing stage; everything lands in one
# folder, which ends with a one-screen summary and summary.json.
#
#   bash scripts/gpu_check.sh [OUT_DIR] [--dry-run] [--prebuilt] [--stages LIST] [--archive FILE]
#                             [--deadline SECONDS]
#
#   OUT_DIR     output folder (default gpu-check-out/ in the repository); emptied first
#   --dry-run   the same stages on the CPU at tiny sizes, the sanitizer skipped (CI runs
#               this so the script cannot rot); builds CPU-only, in place
#   --prebuilt  use the library already in sparsekit/ (built on another machine against
#               another torch >= 2.10: the stable-ABI proof); the build stage imports it
#               and lists its kernels, and builds in place only when it does not load
#   --stages    a comma-separated subset of build, tests, tests-slow, sanitizer, bench;
#               a family name takes all of its stages, or name one (sanitizer-memcheck,
#               bench-collection, ...). Default: all
#   --archive   also pack OUT_DIR into FILE (.tgz): one file to bring back
#   --deadline  end within SECONDS of the start: a stage gets at most the time left (less
#               a margin for the summary) and is skipped when too little is left
#
# The stages' time boxes add up to about 25 minutes (build 240 s, tests 330 s, tests-slow
# 90 s, sanitizer 4 x 90 s, benchmarks 570 s), more than one 10-minute command on a lent
# GPU machine: there, run it as whole commands (nothing is kept between them) with the
# library built here (CUDA build, in place) carried in, each with a deadline inside the
# command's limit; the summary lists what a deadline skipped, for a further command:
#   1) --prebuilt --stages build,tests,tests-slow,sanitizer --deadline 540 --archive $OUT/gc1.tgz
#   2) --prebuilt --stages build,bench --deadline 540 --archive $OUT/gc2.tgz
#
# Environment: PYTHON (default python3), TORCH_CUDA_ARCH_LIST (default 9.0), MAX_JOBS
# (default all cores), GPU_CHECK_BUDGET_SCALE (multiplies every stage's time box),
# GPU_CHECK_WORKERS (pytest-xdist workers for the tests stage, default 12).
# Python packages the tests need (pytest, hypothesis, expecttest, xxhash, tqdm) that the
# machine lacks are installed from wheels in .whl/ when that folder exists (no network).
# The benchmark JSON goes to OUT_DIR/bench/; copy it to benchmarks/results/ to commit it.
set -uo pipefail
caller=$(pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$(pwd)

out=gpu-check-out
dry_run=0
prebuilt=0
stages=build,tests,tests-slow,sanitizer,bench
archive=
deadline=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry_run=1 ;;
    --prebuilt) prebuilt=1 ;;
    --stages) stages=$2; shift ;;
    --stages=*) stages=${1#--stages=} ;;
    --archive) archive=$2; shift ;;
    --archive=*) archive=${1#--archive=} ;;
    --deadline) deadline=$2; shift ;;
    --deadline=*) deadline=${1#--deadline=} ;;
    -h|--help) sed -n '2,39p' "$0"; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) out=$1 ;;
  esac
  shift
done
# Relative paths are the caller's (the default folder lies in the repository).
case "$out" in /*) ;; gpu-check-out) out="$repo/$out" ;; *) out="$caller/$out" ;; esac
case "$archive" in ""|/*) ;; *) archive="$caller/$archive" ;; esac
case "$deadline" in ''|*[!0-9]*) echo "gpu_check.sh: --deadline takes whole seconds, got '$deadline'" >&2; exit 2 ;; esac
known=" build tests tests-slow sanitizer sanitizer-memcheck sanitizer-racecheck sanitizer-synccheck
 sanitizer-initcheck bench bench-ops bench-embedding bench-hashtable bench-lazy-adam bench-layers bench-train
 bench-criteo-reader bench-dynamic bench-collection bench-compile bench-profile bench-harness bench-step bench-bags "
known=" $(echo $known) "  # one line: a name at the end of a line is matched too
for stage in ${stages//,/ }; do
  case "$known" in *" $stage "*) ;; *) echo "gpu_check.sh: unknown stage '$stage' (see --help)" >&2; exit 2 ;; esac
done
rm -rf "$out"
mkdir -p "$out/logs" "$out/bench"
PY=${PYTHON:-python3}
scale=${GPU_CHECK_BUDGET_SCALE:-1}
jobs=${MAX_JOBS:-$(nproc)}
export PYTHONUNBUFFERED=1 SPARSEKIT_BENCH_RESULTS_DIR="$out/bench"
records="$out/stages.tsv"
: > "$records"
run_start=$(date +%s)

# run_stage NAME BUDGET_S COMMAND...: runs COMMAND time-boxed, its output in logs/NAME.log;
# with --deadline, boxed by the time left too (30 s kept for the summary and the archive),
# and skipped when less than 20 s would be left to it.
run_stage() {
  local name=$1 budget=$2
  shift 2
  budget=$(awk -v b="$budget" -v s="$scale" 'BEGIN { printf "%d", b * s }')
  if [ "$deadline" -gt 0 ]; then
    local left=$(( deadline - 30 - ($(date +%s) - run_start) ))
    if [ "$left" -lt 20 ]; then
      skip_stage "$name" "no time left before --deadline $deadline"
      return
    fi
    [ "$left" -lt "$budget" ] && budget=$left
  fi
  local log="$out/logs/$name.log" start status
  start=$(date +%s)
  printf '== %-22s (time box %4d s) ' "$name" "$budget"
  timeout --kill-after=15 "$budget" "$@" > "$log" 2>&1
  local rc=$?
  case $rc in
    0) status=pass ;;
    124|137) status=timeout ;;
    *) status=fail ;;
  esac
  local seconds=$(( $(date +%s) - start ))
  printf '%-7s %4d s\n' "$status" "$seconds"
  [ "$status" = pass ] || tail -n 15 "$log" | sed 's/^/   | /'
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$seconds" "$rc" "logs/$name.log" >> "$records"
}

skip_stage() {
  printf '== %-22s skipped (%s)\n' "$1" "$2"
  printf '%s\t%s\t0\t0\t%s\n' "$1" "skipped" "$2" >> "$records"
}

# wants STAGE: STAGE or its family (the name before the first '-', for sanitizer-* and
# bench-*) is in --stages.
wants() {
  case ",$stages," in *",$1,"*) return 0 ;; esac
  case "$1" in sanitizer-*|bench-*) case ",$stages," in *",${1%%-*},"*) return 0 ;; esac ;; esac
  return 1
}

# ---- environment -------------------------------------------------------------------
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "commit: $(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "dry_run: $dry_run"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  command -v nvcc >/dev/null && nvcc --version | tail -n 2
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0]); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

missing=$("$PY" - <<'PY'
import importlib.util
print(" ".join(m for m in ("pytest", "hypothesis", "expecttest", "xxhash", "tqdm", "numpy")
               if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
  if [ -d "$repo/.whl" ]; then
    echo "installing from .whl/: $missing"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$out/site" "$repo"/.whl/*.whl \
      > "$out/logs/deps.log" 2>&1 || echo "   (wheel install failed: see logs/deps.log)"
    export PYTHONPATH="$out/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "missing Python packages: $missing (put their wheels in .whl/); stages that need them will fail"
  fi
fi

if [ "$dry_run" = 1 ]; then
  export SPARSEKIT_CUDA=0 SPARSEKIT_TEST_DEVICES=cpu
  device=cpu
else
  export SPARSEKIT_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} SPARSEKIT_TEST_DEVICES=cuda
  device=cuda
fi

# ---- build ---------------------------------------------------------------------------
build_in_place() {
  # A persistent build folder per mode, so a second run recompiles only what changed.
  run_stage "$1" 240 env MAX_JOBS="$jobs" "$PY" setup.py build_ext --inplace \
    --build-temp "build/gpu-check-$device"
}
if wants build; then
  if [ "$prebuilt" = 1 ]; then
    run_stage build 60 "$PY" -c "
import torch, sparsekit
from sparsekit import _build_info as info
cuda = torch._C._dispatch_has_kernel_for_dispatch_key('sparsekit::unique', 'CUDA')
print('prebuilt library built with torch', info.TORCH_VERSION, 'running under torch', torch.__version__, 'CUDA kernels:', cuda)
assert cuda or '$device' == 'cpu', 'the prebuilt library has no CUDA kernels'"
    # The proof failed (recorded above); the other stages still need a library.
    [ "$(tail -n 1 "$records" | cut -f2)" = pass ] || build_in_place build-fallback
  else
    build_in_place build
  fi
fi

# ---- tests -----------------------------------------------------------------------------
pytest_base=("$PY" -m pytest -q -p no:cacheprovider -o addopts="" -rfEs)
if wants tests; then
  if [ "$dry_run" = 1 ]; then
    # CI has just run the whole suite on the CPU; the dry run checks the stage's plumbing.
    run_stage tests 120 "${pytest_base[@]}" --junitxml "$out/pytest.xml" tests/cuda/test_cuda_smoke.py tests/ops/test_unique.py
  else
    xdist=()
    "$PY" -c "import xdist" 2>/dev/null && xdist=(-n "${GPU_CHECK_WORKERS:-12}")
    # A hung test is stopped (its worker replaced) instead of eating the stage's time box.
    "$PY" -c "import pytest_timeout" 2>/dev/null &&
      xdist+=(--timeout "${GPU_CHECK_TEST_TIMEOUT:-60}" --timeout-method thread)
    # -vv (one -v only undoes pytest_base's -q): every test's outcome is in the log as it
    # happens, so a stage stopped by its time box (no junit XML then) still names what
    # failed. The slow tests (one holds ~65 GiB of GPU memory) run alone, in tests-slow.
    # OMP_WAIT_POLICY=PASSIVE (the workers set it too, see tests/conftest.py): with the
    # workers and the processes tests spawn outnumbering the cores, OpenMP threads that
    # spin while they wait starve the ones with work (CPU tests 10-20x slower).
    run_stage tests 330 env OMP_WAIT_POLICY=PASSIVE "${pytest_base[@]}" -vv ${xdist[@]+"${xdist[@]}"} -m "not slow" \
      --junitxml "$out/pytest.xml" tests
  fi
fi
if wants tests-slow; then
  if [ "$dry_run" = 1 ]; then
    skip_stage tests-slow "dry run: the slow tests need a GPU"
  else
    run_stage tests-slow 90 "${pytest_base[@]}" -m slow --junitxml "$out/pytest-slow.xml" tests
  fi
fi

# ---- compute-sanitizer ------------------------------------------------------------------
sanitizer_tools=()
for tool in memcheck racecheck synccheck initcheck; do
  wants "sanitizer-$tool" && sanitizer_tools+=("$tool")
done
if [ ${#sanitizer_tools[@]} -gt 0 ]; then
  if [ "$dry_run" = 1 ]; then
    skip_stage sanitizer "dry run: no GPU"
  elif ! command -v compute-sanitizer >/dev/null; then
    skip_stage sanitizer "compute-sanitizer not on PATH"
  else
    # memcheck, racecheck and synccheck instrument only sparsekit's kernels (namespace
    # sparsekit): torch's, cuBLAS's and CUB's run at full speed and their reports cannot fail
    # the stage. initcheck instruments every kernel: it tracks initialisation through the
    # kernels it instruments (and memset/memcpy), so with the filter every tensor torch's
    # kernels filled (torch.zeros, torch.arange, randn on the device) reads as uninitialised
    # in sparsekit's kernels (20,725 false reports on an H200, where the unfiltered run over
    # the same tests reports none and takes 19 s).
    only_ours=()
    sanitizer_help=$(compute-sanitizer --help 2>&1)
    case "$sanitizer_help" in *--kernel-name*) only_ours=(--kernel-name kns=sparsekit) ;; esac
    for tool in "${sanitizer_tools[@]}"; do
      filter=()
      [ "$tool" != initcheck ] && filter=(${only_ours[@]+"${only_ours[@]}"})
      run_stage "sanitizer-$tool" 90 compute-sanitizer --tool "$tool" --error-exitcode 86 \
        --target-processes all --print-limit 20 ${filter[@]+"${filter[@]}"} \
        "${pytest_base[@]}" -x --junitxml "$out/sanitizer-$tool.xml" tests/cuda/test_cuda_smoke.py
    done
  fi
fi

# ---- benchmarks ------------------------------------------------------------------------
# bench_stage NAME BUDGET COMMAND...: run_stage when --stages asks for it.
bench_stage() { if wants "$1"; then run_stage "$@"; fi; }
# The training harness (the README's first command) with each embedding back end: the
# shared table, torch's nn.EmbeddingBag, 26 tables (bash -c "$harness" NAME PY DEVICE ARGS...).
harness='set -e; py=$1 device=$2; shift 2
for backend in "--embedding sparsekit" "--embedding torch" "--tables per-slot"; do
  echo "== python -m sparsekit.train --device $device $backend $*"
  "$py" -m sparsekit.train --device "$device" --no-progress --eval-every 0 $backend "$@"
done'
if [ "$dry_run" = 1 ]; then
  b=(--device cpu)
  bench_stage bench-ops 60 "$PY" benchmarks/bench_ops.py "${b[@]}" --keys 20000 --rows 20000 --dim 8 --segments 500 --repeat 1 --rounds 2 --distributions zipf,distinct
  bench_stage bench-embedding 60 "$PY" benchmarks/bench_embedding.py "${b[@]}" --rows 5000 --bags 256 --pooling 4 --dims 16 --rounds 1 --repeat 1 --skew-lookups 4096 --skew-dim 16
  bench_stage bench-hashtable 60 "$PY" benchmarks/bench_hashtable.py "${b[@]}" --capacity 4096 --queries 4096 --repeat 1
  bench_stage bench-lazy-adam 60 "$PY" benchmarks/bench_lazy_adam.py "${b[@]}" --rows 5000 --dim 8 --unique 500 --repeat 1
  bench_stage bench-layers 60 "$PY" benchmarks/bench_layers.py "${b[@]}" --batch 64 --slots 4 --world-sizes 1 --repeat 1
  bench_stage bench-train 90 "$PY" benchmarks/bench_train.py "${b[@]}" --batch-size 64 --table-rows 4096 --vocab-per-slot 100 --warmup 1 --steps 2 --rounds 1
  bench_stage bench-criteo-reader 60 "$PY" benchmarks/bench_criteo_reader.py --lines 2000 --batch-size 256
  bench_stage bench-dynamic 60 "$PY" benchmarks/bench_dynamic.py "${b[@]}" --quick --repeat 1
  bench_stage bench-collection 90 "$PY" benchmarks/bench_collection.py "${b[@]}" --small --batch 256 --rounds 1 --repeat 1 --world-sizes 1 --configs dim16
  bench_stage bench-compile 90 "$PY" benchmarks/bench_compile.py "${b[@]}" --batch 64 --steps 2 --rounds 1 --repeat 1 --backend aot_eager
  bench_stage bench-profile 60 "$PY" benchmarks/profile_step.py "${b[@]}" --rows 5000 --bags 256 --pooling 4 --dim 16 --steps 3
  bench_stage bench-harness 120 bash -c "$harness" bench-harness "$PY" cpu --steps 3 --batch-size 64 --eval-samples 1024
  bench_stage bench-step 60 "$PY" benchmarks/step_proof.py "${b[@]}" --batch 256
  bench_stage bench-bags 90 "$PY" benchmarks/bench_bags.py "${b[@]}" --cells 16x100k --keys zipf --batch 64 --rounds 1 --repeat 1
else
  b=(--device cuda)
  bench_stage bench-ops 60 "$PY" benchmarks/bench_ops.py "${b[@]}" --repeat 5 --rounds 3 --distributions zipf,distinct,uniform
  bench_stage bench-embedding 60 "$PY" benchmarks/bench_embedding.py "${b[@]}" --rounds 3
  bench_stage bench-hashtable 30 "$PY" benchmarks/bench_hashtable.py "${b[@]}" --rounds 3
  bench_stage bench-lazy-adam 30 "$PY" benchmarks/bench_lazy_adam.py "${b[@]}" --rounds 3
  bench_stage bench-layers 30 "$PY" benchmarks/bench_layers.py "${b[@]}" --world-sizes 1 --rounds 3
  bench_stage bench-train 60 "$PY" benchmarks/bench_train.py "${b[@]}" --rounds 3
  bench_stage bench-dynamic 90 "$PY" benchmarks/bench_dynamic.py "${b[@]}" --repeat 3
  bench_stage bench-collection 60 "$PY" benchmarks/bench_collection.py "${b[@]}" --world-sizes 1 --rounds 2 --repeat 3
  bench_stage bench-compile 120 "$PY" benchmarks/bench_compile.py "${b[@]}" --steps 8 --rounds 3 --repeat 2
  bench_stage bench-profile 30 "$PY" benchmarks/profile_step.py "${b[@]}"
  bench_stage bench-harness 120 bash -c "$harness" bench-harness "$PY" cuda --steps 200
  bench_stage bench-step 60 "$PY" benchmarks/step_proof.py "${b[@]}"
  bench_stage bench-bags 120 "$PY" benchmarks/bench_bags.py "${b[@]}" --batch 16384 --min-ids 20 --max-ids 20 --cells 16x100k,64x1m --memory-gib 60 --rounds 3
fi

# ---- summary ---------------------------------------------------------------------------
"$PY" - "$out" "$dry_run" "$(( $(date +%s) - run_start ))" <<'PY'
import json, os, sys
out, dry_run, total = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3])
stages = []
with open(os.path.join(out, "stages.tsv")) as f:
    for line in f:
        name, status, seconds, rc, log = line.rstrip("\n").split("\t")
        stages.append({"stage": name, "status": status, "seconds": int(seconds), "exit_code": int(rc), "log": log})
env = open(os.path.join(out, "env.txt")).read()
summary = {"dry_run": dry_run, "total_seconds": total, "env": env.splitlines(), "stages": stages,
           "benchmark_json": sorted(os.listdir(os.path.join(out, "bench"))),
           "ok": all(s["status"] in ("pass", "skipped") for s in stages)}
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
    f.write("\n")
print()
print(f"{'stage':<24}{'status':<9}{'seconds':>8}")
for s in stages:
    print(f"{s['stage']:<24}{s['status']:<9}{s['seconds']:>8}")
print(f"{'total':<24}{'ok' if summary['ok'] else 'FAILED':<9}{total:>8}")
print(f"summary: {os.path.join(out, 'summary.json')}")
sys.exit(0 if summary["ok"] else 1)
PY
status=$?
if [ -n "$archive" ]; then
  if tar czf "$archive" -C "$(dirname "$out")" "$(basename "$out")"; then
    echo "archive: $archive"
  else
    echo "gpu_check.sh: could not write the archive $archive" >&2
    status=1
  fi
fi
exit $status

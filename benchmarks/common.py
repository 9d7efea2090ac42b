"""Shared pieces of the sparsekit benchmarks: timing, Zipf keys, and the JSON record.

Every benchmark runs sparsekit and its competitors side by side in one process and
reports ratios; absolute times from different runs are never compared.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import signal
import subprocess
import time
from typing import Callable, Dict, Iterator, List, Sequence

import numpy as np
import torch

from sparsekit.allocator import keep_freed_memory

# SPARSEKIT_BENCH_RESULTS_DIR redirects the JSON (scripts/gpu_check.sh writes it into its
# output folder, so a check run never overwrites the committed results).
RESULTS_DIR = os.environ.get("SPARSEKIT_BENCH_RESULTS_DIR") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "results")

# Every side of every benchmark runs with freed memory kept for reuse (what a training
# loop should do, see sparsekit.allocator); SPARSEKIT_BENCH_SYSTEM_MALLOC=1 measures glibc's
# defaults instead. The JSON records which.
MALLOC = "system" if os.environ.get("SPARSEKIT_BENCH_SYSTEM_MALLOC") == "1" else (
    "keeps freed memory" if keep_freed_memory() else "system (not glibc)")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, *, warmup: int = 2, repeat: int = 5) -> float:
    """Median wall time of fn() in seconds, with the device synchronised around each call."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times: List[float] = []
    for _ in range(repeat):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def best_of(fn: Callable[[], object], device: torch.device, repeat: int, *,
            clock: Callable[[], float] = time.perf_counter, setup: Callable[[], object] | None = None) -> float:
    """Fastest of `repeat` calls of fn() in seconds of `clock`, the device synchronised around
    each; setup() (untimed) runs before each call when given."""
    times: List[float] = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        synchronize(device)
        start = clock()
        fn()
        synchronize(device)
        times.append(clock() - start)
    return min(times)


def time_rounds(fns: dict[str, Callable[[], object]], device: torch.device, *, rounds: int, repeat: int,
                clock: Callable[[], float] = time.perf_counter,
                setup: dict[str, Callable[[], object]] | None = None) -> dict[str, list[float]]:
    """Per side, the best of `repeat` calls in each of `rounds` interleaved rounds (round 1:
    every side in turn, then round 2, ...), so that a noisy spell of a shared machine hits
    the sides of one round alike. Every side is called twice first (warm-up). `clock` is the
    timer (time.thread_time for one CPU thread: immune to other processes); setup[name]()
    runs untimed before each call of that side (e.g. emptying a table an insert fills)."""
    setup = setup or {}
    for name, fn in fns.items():
        for _ in range(2):
            if name in setup:
                setup[name]()
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(best_of(fn, device, repeat, clock=clock, setup=setup.get(name)))
    return times


def ratio_stats(base: Sequence[float], ours: Sequence[float]) -> Dict:
    """base / ours per round, and their min, median and max."""
    ratios = [round(b / o, 3) for b, o in zip(base, ours)]
    return {"min": min(ratios), "median": float(np.median(ratios)), "max": max(ratios), "rounds": ratios}


def fmt_ratio(stats: Dict) -> str:
    """``x3.05 (2.81-3.30)``: the median and the range over rounds."""
    return f"x{stats['median']:.2f} ({stats['min']:.2f}-{stats['max']:.2f})"


def _spin(parent: int, ready) -> None:
    """Spin until the benchmark that started it is gone: its ``finally`` stops the spinner,
    but a benchmark killed by a signal (SIGTERM, SIGKILL) never runs it, and the spinner
    must not stay behind at 100% of a core. Ctrl-C is left to the benchmark."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ready.set()
    while os.getppid() == parent:
        for _ in range(1 << 16):  # about a millisecond between checks
            pass


@contextlib.contextmanager
def busy_core(enabled: bool) -> Iterator[None]:
    """While active (when enabled), a separate process spins on one core, as other work
    does on a user's shared machine."""
    if not enabled:
        yield
        return
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    spinner = context.Process(target=_spin, args=(os.getpid(), ready), daemon=True)
    spinner.start()
    try:
        # A spawned process imports this module (torch, numpy) before it spins: seconds, not
        # the 0.2 s once slept here, during which the first rounds ran with no busy core.
        while not ready.wait(timeout=0.1):
            if not spinner.is_alive():
                raise RuntimeError(f"--busy-core: the spinning process exited (code {spinner.exitcode}) "
                                   "before it started spinning")
        yield
    finally:
        spinner.terminate()
        spinner.join()


def add_round_args(parser: argparse.ArgumentParser, *, rounds: int = 7, repeat: int = 5) -> None:
    """--rounds, --repeat and --busy-core, with the meaning of time_rounds and busy_core."""
    parser.add_argument("--rounds", type=int, default=rounds, help="interleaved rounds (ratios: min/median/max)")
    parser.add_argument("--repeat", type=int, default=repeat, help="calls per side and round (the best counts)")
    parser.add_argument("--busy-core", action="store_true",
                        help="measure with a spinning process on one core (started by the benchmark)")


def copy_bandwidth(device: torch.device, nbytes: int, *, repeat: int = 5) -> float:
    """Bytes per second of a device-to-device copy of nbytes (read + write both counted):
    the hardware limit that bandwidth-bound kernels are measured against."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    seconds = time_fn(lambda: dst.copy_(src), device, repeat=repeat)
    return 2 * src.numel() * 4 / seconds


def read_bandwidth(data: torch.Tensor, *, repeat: int = 5) -> float:
    """Bytes per second torch.sum streams through `data` (host memory, far larger than the
    caches) on the threads torch uses now, the best of repeat calls: the rate a kernel that
    must read its bytes from memory is measured against."""
    seconds = best_of(lambda: data.sum(), torch.device("cpu"), repeat)
    return data.numel() * data.element_size() / seconds


def zipf_keys(n: int, *, alpha: float = 1.2, vocabulary: int = 1 << 40, seed: int = 0) -> torch.Tensor:
    """n int64 keys whose ranks follow a Zipf law, scattered over a wide key range."""
    rng = np.random.default_rng(seed)
    ranks = rng.zipf(alpha, n).astype(np.uint64) % np.uint64(vocabulary)
    # A fixed odd multiplier spreads ranks over the int64 range like real hashed ids.
    keys = (ranks * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)
    return torch.from_numpy(keys.copy())


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's "model name"): platform.processor() is
    empty on Linux and platform.machine() only says x86_64."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model()} ({torch.get_num_threads()} threads)"


def _git(*args: str) -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # GIT_OPTIONAL_LOCKS=0: `git status` must not rewrite the index of the checkout it reads.
    return subprocess.check_output(["git", "-C", root, *args], text=True, stderr=subprocess.DEVNULL,
                                   env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})


def git_commit() -> str:
    try:
        return _git("rev-parse", "HEAD").strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def uncommitted_changes() -> list[str] | None:
    """Tracked files that differ from the commit (benchmarks/results/ aside): a run measures
    the working tree, so "commit" alone does not say which code made the figures when this
    is not empty. None where git is not available."""
    try:
        status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results")
    except (OSError, subprocess.CalledProcessError):
        return None
    return sorted(line[3:] for line in status.splitlines() if line.strip())


def write_results(name: str, device: torch.device, rows: List[Dict], extra: Dict | None = None,
                  file_name: str | None = None) -> str:
    """Write rows as benchmarks/results/<file_name or name>_<device type>.json and return the
    path (``file_name``: a second record of one benchmark, e.g. another shape of its input)."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    record = {
        "benchmark": name,
        "device": device_name(device),
        "device_type": device.type,
        "torch": torch.__version__,
        "commit": git_commit(),
        "uncommitted_changes": uncommitted_changes(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "malloc": MALLOC,
        "results": rows,
    }
    if extra:
        record.update(extra)
    path = os.path.join(RESULTS_DIR, f"{file_name or name}_{device.type}.json")
    with open(path, "w") as out:
        json.dump(record, out, indent=2)
        out.write("\n")
    return path

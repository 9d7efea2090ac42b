"""Render benchmarks/results/*.json as docs/benchmarks.md and the README's summary table.

    python -m benchmarks.report            # write docs/benchmarks.md and the README block
    python -m benchmarks.report --check    # write nothing; exit 1 if either is out of date

Every bench_*.py script records its figures as JSON (benchmarks/common.py:write_results);
this module is the only place that turns them into prose. It reads each file, extracts one
row per measured configuration and competitor (each benchmark's schema has its own
extractor; an unknown schema falls back to every ratio it finds), and renders them in a
fixed order with fixed float formatting, so two runs over the same JSON write the same
bytes. It imports neither torch nor sparsekit: CI runs `--check` on any machine.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "benchmarks", "results")
SCRIPTS_DIR = os.path.join(ROOT, "benchmarks")
PAGE_PATH = os.path.join(ROOT, "docs", "benchmarks.md")
README_PATH = os.path.join(ROOT, "README.md")

README_BEGIN = "<!-- benchmarks:begin"
README_END = "<!-- benchmarks:end -->"
MISSING = "-"
SWITCH = "<switch>"  # a command-line option without a value
CELL_ROWS = {100_000: "100k", 1_000_000: "1m"}  # bench_bags' --cells names of table sizes

# The page lists the benchmarks in this order; a family not named here follows, by name.
FAMILY_ORDER = ("ops", "embedding", "bags", "torchrec", "lazy_adam", "layers", "collection", "train",
                "hashtable", "dynamic", "huge_pages", "compile", "criteo_reader")
FAMILY_TITLES = {
    "ops": "`unique` and `segment_sum`", "embedding": "`embedding_bag`",
    "bags": "Bags of many ids, one table per feature", "torchrec": "Fused training against TorchRec's kernel",
    "lazy_adam": "`LazyAdam`", "layers": "`DistributedEmbedding` training step",
    "collection": "`EmbeddingBagCollection` training step", "train": "The training harness",
    "hashtable": "`HashTable` build and find", "dynamic": "`HashTable` inserts that evict",
    "huge_pages": "Tables in transparent huge pages", "compile": "`torch.compile` of the harness's step",
    "criteo_reader": "Criteo TSV reader",
}


class ReportError(ValueError):
    """A results file the report cannot read; the message names the file."""


@dataclass(frozen=True)
class Ratio:
    """Competitor time / sparsekit time: the median over rounds and, where the JSON keeps
    rounds, their min, max and count (None where it recorded a single figure)."""

    median: float
    low: float | None = None
    high: float | None = None
    rounds: int | None = None


@dataclass(frozen=True)
class Run:
    """One results file: its stem (`ops_busy_cpu`), benchmark family (`ops`) and content."""

    name: str
    family: str
    busy: bool
    data: dict


@dataclass(frozen=True)
class Row:
    """One line of the page; `tag` lets the README summary pick rows without parsing text."""

    run: Run
    tag: str
    measured: str
    against: str
    ratio: Ratio | None


# ---------------------------------------------------------------- reading the JSON
def load_runs(results_dir: str) -> tuple[list[Run], list[tuple[str, dict]]]:
    """Every *.json under results_dir, sorted by name: benchmark records (a `results` list)
    and check records (a `runs` list, e.g. scripts/gpu_check.sh's). Raises ReportError
    naming the file for anything else."""
    runs, checks = [], []
    for file in sorted(f for f in os.listdir(results_dir) if f.endswith(".json")):
        path = os.path.join(results_dir, file)
        try:
            with open(path) as handle:
                data = json.load(handle)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ReportError(f"{path}: not readable JSON ({error})") from error
        if not isinstance(data, dict):
            raise ReportError(f"{path}: expected a JSON object at the top, found {type(data).__name__}")
        name = file[:-len(".json")]
        if "results" in data:
            results = data["results"]
            if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
                raise ReportError(f"{path}: 'results' must be a list of objects")
            benchmark = data.get("benchmark") or re.sub(r"_(cpu|cuda)$", "", name)
            if not isinstance(benchmark, str):
                raise ReportError(f"{path}: 'benchmark' must be a string")
            busy = benchmark.endswith("_busy") or "_busy_" in file or data.get("busy_core") is True
            family = benchmark.removesuffix("_busy")
            runs.append(Run(name, family, busy, data))
        elif isinstance(data.get("runs"), list):
            checks.append((name, data))
        else:
            raise ReportError(f"{path}: neither a benchmark record ('results') nor a check record ('runs')")
    return runs, checks


def ratio_of(value: object) -> Ratio | None:
    """A Ratio from what benchmarks/common.py:ratio_stats writes, or from a bare number."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return Ratio(float(value))
    if isinstance(value, dict) and isinstance(value.get("median"), (int, float)):
        rounds = value.get("rounds")
        return Ratio(float(value["median"]), _number(value.get("min")), _number(value.get("max")),
                     len(rounds) if isinstance(rounds, list) else None)
    raise ValueError(f"not a ratio: {value!r}")


def _number(value: object) -> float | None:
    return None if isinstance(value, bool) or not isinstance(value, (int, float)) else float(value)


# ---------------------------------------------------------------- formatting
def count(value: object) -> str:
    """4000000 -> 4M, 100000 -> 100k, 1048576 -> 2^20, 421424 -> 421,424; None -> '-'."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        return MISSING if value is None else str(value)
    if value >= 1 << 16 and value & (value - 1) == 0:
        return f"2^{value.bit_length() - 1}"
    if value >= 1_000_000 and value % 1_000_000 == 0:
        return f"{value // 1_000_000}M"
    if value >= 10_000 and value % 1_000 == 0:
        return f"{value // 1_000}k"
    return f"{value:,}"


def text(value: object) -> str:
    return MISSING if value is None else str(value)


def fmt_ratio(ratio: Ratio | None) -> str:
    return MISSING if ratio is None else f"x{ratio.median:.2f}"


def fmt_range(ratio: Ratio | None) -> str:
    if ratio is None or ratio.low is None or ratio.high is None:
        return MISSING
    rounds = f" ({ratio.rounds} rounds)" if ratio.rounds else ""
    return f"{ratio.low:.2f}-{ratio.high:.2f}{rounds}"


def fmt_commit(data: dict) -> str:
    """The commit's first 7 digits, with the count of tracked files the run had changed."""
    commit = data.get("commit")
    if not isinstance(commit, str) or not commit or commit == "unknown":
        return MISSING
    changed = data.get("uncommitted_changes")
    return f"`{commit[:7]}`" + (f" +{len(changed)} files" if isinstance(changed, list) and changed else "")


def cell(value: str) -> str:
    return value.replace("|", "\\|").replace("\n", " ")


def table(header: Sequence[str], lines: Iterable[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(cell(v) for v in line) + " |" for line in lines]
    return out


# ---------------------------------------------------------------- one extractor per schema
# Each takes (run, result row) and returns (tag, measured, against, ratio value) tuples;
# a missing field renders as "-" (count/text), a malformed one raises.

Extracted = list[tuple[str, str, str, object]]


def ops_rows(run: Run, r: dict) -> Extracted:
    if r.get("op") == "unique":
        dist = r.get("distribution")
        shape = {"zipf": f"Zipf({text(r.get('zipf_alpha'))})", "distinct": "all distinct",
                 "uniform": "uniform over n/4 values"}.get(dist, text(dist))
        return [(f"unique:{dist}", (f"`unique`, {count(r.get('keys'))} int64 keys, {shape}, "
                 f"{count(r.get('unique_keys'))} distinct"),
                 "`torch.unique` (faster of sorted / unsorted, inverse + counts)", r.get("ratio"))]
    if r.get("op") == "segment_sum":
        deterministic = r.get("deterministic") is True
        return [("segment_sum:deterministic" if deterministic else "segment_sum",
                 f"`segment_sum`, {count(r.get('rows'))} x {text(r.get('dim'))} rows into "
                 f"{count(r.get('segments'))} segments" + (", deterministic" if deterministic else ""),
                 "`index_add_`", r.get("ratio"))]
    return generic_rows(run, r)


EMBEDDING_SIDES = {
    "nn.EmbeddingBag": "`nn.EmbeddingBag`",
    "sparsekit[every]": "sparsekit forced to prefetch every line of a row",
    "sparsekit[first]": "sparsekit forced to prefetch a row's first line",
}


def embedding_rows(run: Run, r: dict) -> Extracted:
    if r.get("phase") == "backward_skew":
        return [("skew", (f"`embedding_bag` backward, {count(r.get('lookups'))} lookups at "
                 f"D={text(r.get('dim'))}, every lookup on its own row"),
                 "every lookup on row 0", r.get("ratio"))]
    threads = r.get("threads")
    mode = r.get("mode")
    measured = (f"`embedding_bag` {text(r.get('phase'))}"
                + (f" ({mode})" if mode and mode != "sum" else "")
                + f", {count(r.get('rows'))} x {text(r.get('dim'))} table, {count(r.get('bags'))} bags "
                f"of {text(r.get('pooling'))}, {text(r.get('distribution'))} rows, "
                f"{text(threads)} thread{'' if threads == 1 else 's'}")
    ratios = r.get("ratios") or {"nn.EmbeddingBag": r.get("ratio")}
    return [(text(r.get("phase")), measured, EMBEDDING_SIDES.get(side, f"`{side}`"), stats)
            for side, stats in ratios.items()]


BAGS_ENTRIES = (
    ("forward_vs_bags", "forward, direct tables", "`nn.EmbeddingBag` per table"),
    ("forward_hashed_vs_bags", "forward, hash tables", "`nn.EmbeddingBag` per table"),
    ("forward_vs_torchrec", "forward, direct tables", "TorchRec `EmbeddingBagCollection`"),
    ("train_lazy_adam_vs_torch", "training step, `LazyAdam`", "`nn.EmbeddingBag` + `SparseAdam`"),
    ("train_fused_adam_vs_torch", "training step, fused Adam", "`nn.EmbeddingBag` + `SparseAdam`"),
    ("train_fused_adagrad_vs_torch", "training step, fused row-wise Adagrad",
     "`nn.EmbeddingBag` + `SparseAdam`"),
)


TBE = "FBGEMM TBE (TorchRec's kernel), the same optimizer fused"
TORCHREC_ENTRIES = (
    ("forward_vs_tbe", "forward", "FBGEMM TBE (TorchRec's kernel)"),
    ("train_rowwise_adagrad_vs_tbe", "training step, fused row-wise Adagrad", TBE),
    ("train_sgd_vs_tbe", "training step, fused SGD", TBE),
    ("train_adagrad_vs_tbe", "training step, fused Adagrad", TBE),
)


def bags_rows(run: Run, r: dict) -> Extracted:
    ids = r.get("ids_per_bag")
    keys = text(r.get("keys"))
    if not (isinstance(ids, list) and len(ids) == 2):
        bag = f"{MISSING} {keys} ids"
    else:
        bag = f"{ids[0]} {keys} id" if ids[0] == ids[1] else f"{ids[0]}-{ids[1]} {keys} ids"
    base = f"tables of {count(r.get('rows'))} x {text(r.get('dim'))}, batch {count(r.get('batch'))}, bags of {bag}"
    entries = TORCHREC_ENTRIES if run.family == "torchrec" else BAGS_ENTRIES
    return [(key, f"{base}: {what}", against, r[key]) for key, what, against in entries if key in r]


def collection_rows(run: Run, r: dict) -> Extracted:
    dims = r.get("dims")
    dim_text = "/".join(str(d) for d in sorted(set(dims))) if isinstance(dims, list) and dims else MISSING
    world = r.get("world_size")
    tables = f" ({len(dims)} tables, D {dim_text})" if dim_text != MISSING else ""
    pooling = r.get("pooling")
    base = (f"{text(r.get('config'))}{tables}, batch {count(r.get('batch'))}, {text(pooling)} "
            f"key{'' if pooling == 1 else 's'} a bag, world {text(world)}"
            + (f" ({r['backend']})" if r.get("backend") else ""))
    entries = (
        ("speedup_vs_26_layers", base, "one `DistributedEmbedding` layer per table"),
        ("speedup_vs_torch", base, "one `nn.EmbeddingBag` per table + `SparseAdam`"),
        ("speedup_vs_26_layers_less_loss", base + ", the shared loss off both sides",
         "one `DistributedEmbedding` layer per table"),
        ("bf16_speed_vs_fp32", base + ", bf16 tables", "the same collection with fp32 tables"),
    )
    return [(f"{key}:w{world}", what, against, r[key]) for key, what, against in entries if key in r]


def compile_rows(run: Run, r: dict) -> Extracted:
    return [("compile", (f"harness step compiled ({text(r.get('backend'))}), {text(r.get('tables'))} "
             f"tables, batch {count(r.get('batch'))}, {text(r.get('steps_per_call'))} steps a call"),
             "the same step eager", r.get("compiled_speedup"))]


def criteo_reader_rows(run: Run, r: dict) -> Extracted:
    rate = r.get("lines_per_s")
    rate_text = f"{rate:,.0f} lines/s" if isinstance(rate, (int, float)) else MISSING
    return [("reader", (f"Criteo TSV reader, {count(r.get('lines'))} lines, batch "
             f"{count(r.get('batch_size'))}: {rate_text}"), "reading and splitting the lines only",
             r.get("fraction_of_split_only"))]


def dynamic_rows(run: Run, r: dict) -> Extracted:
    # The JSON's ratio is evicting time / plain time: the plain insert is the side measured.
    policy = text(r.get("policy")).upper()
    base = (f"`HashTable.insert` of {count(r.get('new_keys_per_call'))} new keys into a table with "
            f"room, capacity {count(r.get('capacity'))}, load {text(r.get('load'))}")
    rows = [(f"evict:{r.get('policy')}", base, f"the same insert into a full {policy} table (evicting)",
             r.get("ratio_evict_vs_plain"))]
    if "ratio_stream_vs_plain" in r:
        rows.append((f"stream:{r.get('policy')}", base,
                     f"a full {policy} table over a whole tombstone cycle (rebuild included)",
                     r["ratio_stream_vs_plain"]))
    return rows


def hashtable_rows(run: Run, r: dict) -> Extracted:
    where = (f"capacity {count(r.get('capacity'))}, load {text(r.get('load_factor'))}, "
             f"{text(r.get('distribution'))} keys")
    rows = [("find", f"`HashTable.find` of {count(r.get('queries'))} keys, {where}",
             "`torch.searchsorted` on a sorted key array", r.get("ratio"))]
    if "build_ratio" in r:
        rows.append(("build", (f"`HashTable.insert` of {count(r.get('resident_keys'))} keys into an empty "
                     f"table, {where}"), "`torch.sort` of the keys", r["build_ratio"]))
    if "find_speedup_vs_dict" in r:
        rows.append(("find_dict", f"`HashTable.find`, {where}", "a Python dict (100k-key slice)",
                     r["find_speedup_vs_dict"]))
    return rows


def huge_pages_rows(run: Run, r: dict) -> Extracted:
    what = {"embedding_bag": "`embedding_bag`", "layer_step": "`DistributedEmbedding` training step"}
    return [(text(r.get("what")), (f"{what.get(r.get('what'), text(r.get('what')))}, "
             f"D={text(r.get('dim'))}, table in huge pages (THP {text(run.data.get('thp'))})"),
             "the same table in 4 KiB pages", r.get("speedup"))]


def layers_rows(run: Run, r: dict) -> Extracted:
    world = r.get("world_size")
    base = (f"`DistributedEmbedding` + `LazyAdam` step, batch {count(r.get('batch'))}, "
            f"{text(r.get('slots'))} slots of up to {text(r.get('max_nnz'))} keys, D={text(r.get('dim'))}")
    if world == 1 or "ratio" in r:
        return [("vs_torch", base, "`nn.EmbeddingBag(sparse=True)` + `SparseAdam`", r.get("ratio"))]
    # Recorded as world-N step time / world-1 step time; the page's ratios are the other way up.
    slower = r.get("step_time_vs_world_1")
    ratio = 1.0 / slower if isinstance(slower, (int, float)) and slower > 0 else None
    backend = f" ({r['backend']})" if r.get("backend") else ""
    return [(f"world{world}", f"{base}, world {text(world)}{backend}",
             "the same layers at world 1", ratio)]


def lazy_adam_rows(run: Run, r: dict) -> Extracted:
    return [(text(r.get("case")), (f"`LazyAdam.step`, {count(r.get('rows'))} x {text(r.get('dim'))} table, "
             f"{count(r.get('unique_rows'))} rows touched, {count(r.get('gradient_entries'))} gradient "
             f"entries ({text(r.get('case'))})"), "`torch.optim.SparseAdam`", r.get("ratio"))]


def train_rows(run: Run, r: dict) -> Extracted:
    base = (f"DLRM training step, batch {count(r.get('batch_size'))}, D={text(r.get('embedding_dim'))}, "
            f"{count(r.get('table_rows'))}-row table, {text(r.get('steps_per_round'))} steps a round")
    rows = [("step", base + ", batches made beforehand",
             "`nn.EmbeddingBag` + `SparseAdam` (`--embedding torch`)", r.get("ratio"))]
    if "harness_ratio" in r:
        rows.append(("harness", base + ", each batch made before its step (harness samples/s)",
                     "`--embedding torch`", r["harness_ratio"]))
    return rows


def generic_rows(run: Run, r: dict) -> Extracted:
    """An unknown schema: one row per ratio-like entry, described by the row's scalars."""
    scalars = ", ".join(f"{k}={v}" for k, v in sorted(r.items())
                        if isinstance(v, (str, int, float, bool)) and not k.endswith("_s"))
    return [(key, scalars or MISSING, key, value) for key, value in sorted(r.items())
            if isinstance(value, dict) and "median" in value]


EXTRACTORS: dict[str, Callable[[Run, dict], Extracted]] = {
    "ops": ops_rows, "embedding": embedding_rows, "bags": bags_rows, "torchrec": bags_rows,
    "collection": collection_rows,
    "compile": compile_rows, "criteo_reader": criteo_reader_rows, "dynamic": dynamic_rows,
    "hashtable": hashtable_rows, "huge_pages": huge_pages_rows, "layers": layers_rows,
    "lazy_adam": lazy_adam_rows, "train": train_rows,
}


def rows_of(run: Run) -> list[Row]:
    extract = EXTRACTORS.get(run.family, generic_rows)
    rows = []
    for index, result in enumerate(run.data["results"]):
        try:
            for tag, measured, against, value in extract(run, result):
                rows.append(Row(run, tag, ("busy core: " if run.busy else "") + measured, against,
                                ratio_of(value)))
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
            raise ReportError(f"{run.name}.json: results[{index}] does not fit the '{run.family}' "
                              f"schema ({type(error).__name__}: {error})") from error
    return rows


# ---------------------------------------------------------------- reproducing commands
def script_flags(script: str) -> set:
    """The options a bench script's argparse accepts, read from its source."""
    with open(script) as handle:
        source = handle.read()
    flags = set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", source))
    if "add_round_args(" in source:
        flags |= {"--rounds", "--repeat", "--busy-core"}
    return flags


def _joined(values: Iterable[object]) -> str | None:
    seen: list[str] = []
    for value in values:
        if value is not None and str(value) not in seen:
            seen.append(str(value))
    return ",".join(seen) or None


def grid_args(run: Run) -> list[tuple[str, str | None]]:
    """The options a run's JSON records besides the common ones (device, rounds, threads)."""
    results, data = run.data["results"], run.data
    if run.family == "ops":
        unique = [r for r in results if r.get("op") == "unique"]
        return [("--distributions", _joined(r.get("distribution") for r in unique))]
    if run.family == "embedding":
        main = [r for r in results if r.get("phase") != "backward_skew"]
        args = [("--dims", _joined(r.get("dim") for r in main))]
        if isinstance(data.get("modes"), list):
            args.append(("--modes", _joined(data["modes"])))
        if any(str(side).startswith("sparsekit[") for r in main for side in r.get("ratios", {})):
            args.append(("--prefetch-plans", SWITCH))
        if not any(r.get("phase") == "backward_skew" for r in results):
            args.append(("--skew-lookups", "0"))
        return args
    if run.family in ("bags", "torchrec"):
        cells = (f"{r.get('dim')}x{CELL_ROWS.get(r.get('rows'), r.get('rows'))}" for r in results)
        args = [("--cells", _joined(cells)), ("--keys", _joined(r.get("keys") for r in results))]
        ids = {tuple(r.get("ids_per_bag") or (10, 30)) for r in results}
        if len(ids) == 1 and ids != {(10, 30)}:
            (low, high), = ids
            args += [("--min-ids", str(low)), ("--max-ids", str(high))]
        if run.family == "bags" and not any("train_s" in r for r in results):
            args.append(("--no-train", SWITCH))
        return args
    if run.family in ("collection", "layers"):
        args = [("--world-sizes", _joined(r.get("world_size") for r in results))]
        if run.family == "collection":
            args.append(("--configs", _joined(r.get("config") for r in results)))
        return args
    if run.family == "dynamic":
        return [("--loads", _joined(r.get("load") for r in results))]
    if run.family == "huge_pages":
        return [("--dims", _joined(r.get("dim") for r in results if r.get("what") == "embedding_bag")),
                ("--layer-dims", _joined(r.get("dim") for r in results if r.get("what") == "layer_step"))]
    if run.family == "train" and results:
        return [("--rounds", text(results[0].get("rounds")))]
    return []


def command_of(run: Run, scripts_dir: str) -> str:
    """The JSON's own `command` if it records one, else the bench script with the options
    its JSON records (an option it does not record stays at the script's default)."""
    recorded = run.data.get("command")
    if isinstance(recorded, list):
        return " ".join(str(part) for part in recorded)
    if isinstance(recorded, str):
        return recorded
    script = os.path.join(scripts_dir, f"bench_{run.family}.py")
    if not os.path.exists(script):
        return MISSING
    data = run.data
    threads = data.get("threads", data.get("threads_per_process"))
    rounds_flag = "--repeat" if run.family == "dynamic" else "--rounds"  # its "rounds" are repeats
    args = [("--device", data.get("device_type"))] + grid_args(run) + [
        ("--threads", _joined(threads) if isinstance(threads, list) else threads),
        (rounds_flag, data.get("rounds")),
        ("--repeat", data.get("repeat") if run.family != "dynamic" else None),
    ]
    flags = script_flags(script)
    words = [f"python benchmarks/bench_{run.family}.py"]
    emitted = set()
    if run.busy:
        args.append(("--busy-core", SWITCH))
    for flag, value in args:
        if flag in flags and flag not in emitted and value is not None and value != MISSING:
            words.append(flag if value is SWITCH else f"{flag} {value}")
            emitted.add(flag)
    return " ".join(words)


# ---------------------------------------------------------------- the page
HEADER = """\
# Benchmarks

<!-- Generated by `python -m benchmarks.report` from benchmarks/results/*.json: do not edit. -->

This page is generated from `benchmarks/results/*.json` by `python -m benchmarks.report`: do
not edit it by hand. Rerun a benchmark (its command is under its table), then the report;
`python -m benchmarks.report --check` fails while the page is stale.

**How the ratios are measured.** Each benchmark runs sparsekit and its competitor side by side
in one process, on the same inputs, in interleaved rounds (every side once per round, the best
of a few calls each), so a noisy spell of the machine hits both sides of a round alike. A ratio
is the competitor's time / sparsekit's time: above 1 sparsekit is faster, below 1 slower, as
measured. The tables give the median over rounds and the min-max with the number of rounds;
`-`: the JSON does not record it. *Busy core* rows ran with a process spinning on one core
(the `*_busy_*` files). Device: as the run recorded it (CPU model and intra-op threads, or GPU
name). Commit: the one checked out, `+N files` where the measured working tree had N tracked
files changed. Commands are rebuilt from the options the JSON records; an option it does not
record was left at the script's default.
"""


def script_summary(scripts_dir: str, family: str) -> str | None:
    """The first paragraph of the bench script's docstring, on one line."""
    path = os.path.join(scripts_dir, f"bench_{family}.py")
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        doc = ast.get_docstring(ast.parse(handle.read()))
    return " ".join(doc.strip().split("\n\n")[0].split()) if doc else None


def family_sort_key(family: str) -> tuple[int, str]:
    return (FAMILY_ORDER.index(family) if family in FAMILY_ORDER else len(FAMILY_ORDER), family)


def run_sort_key(run: Run) -> tuple[str, bool, str]:
    return (text(run.data.get("device_type")), run.busy, run.name)


def render_family(family: str, runs: list[Run], scripts_dir: str) -> list[str]:
    out = [f"## {FAMILY_TITLES.get(family, family)}", ""]
    summary = script_summary(scripts_dir, family)
    if summary:
        out += [f"`benchmarks/bench_{family}.py`: {summary}", ""]
    lines = [(row.measured, row.against, fmt_ratio(row.ratio), fmt_range(row.ratio),
              text(row.run.data.get("device")), text(row.run.data.get("torch")), fmt_commit(row.run.data))
             for run in runs for row in rows_of(run)]
    out += table(("Measured", "Against", "Ratio", "Min-max", "Device", "torch", "Commit"), lines)
    out += ["", "Reproduce:", ""]
    for run in runs:
        recorded = run.data.get("time")
        out.append(f"- `{run.name}.json`" + (f" (recorded {recorded})" if recorded else "")
                   + f": `{command_of(run, scripts_dir)}`")
    return out + [""]


def check_lines(name: str, data: dict) -> list[Sequence[str]]:
    """One line per call of a scripts/gpu_check.sh record, from its `env` lines and stages."""
    lines = []
    for index, run in enumerate(data["runs"], 1):
        if not isinstance(run, dict):
            raise ReportError(f"{name}.json: runs[{index - 1}] is not an object")
        env = "\n".join(str(line) for line in run.get("env") or [])
        commit = re.search(r"^commit: (\S+)$", env, re.MULTILINE)
        runtime = re.search(r"^torch (\S+) .*gpu (.+)$", env, re.MULTILINE)
        stages = ", ".join(f"{s.get('stage')} {s.get('status')}" for s in run.get("stages") or []
                           if isinstance(s, dict))
        lines.append((f"`{name}.json`", str(run.get("call", index)), stages or MISSING,
                      runtime.group(2) if runtime else MISSING, runtime.group(1) if runtime else MISSING,
                      fmt_commit({"commit": commit.group(1) if commit else None})))
    return lines


def render_page(results_dir: str = RESULTS_DIR, scripts_dir: str = SCRIPTS_DIR) -> str:
    """docs/benchmarks.md's full text for the JSON under results_dir."""
    runs, checks = load_runs(results_dir)
    out = HEADER.splitlines() + [""]
    families = sorted({run.family for run in runs}, key=family_sort_key)
    for family in families:
        out += render_family(family, sorted((r for r in runs if r.family == family), key=run_sort_key),
                             scripts_dir)
    if checks:
        out += ["## GPU check runs", "",
                ("Records of `scripts/gpu_check.sh` (no ratios): each call's stages and their outcome. "
                "The JSON holds the notes and logs' names."), ""]
        out += table(("File", "Call", "Stages", "GPU", "torch", "Commit"),
                     [line for name, data in checks for line in check_lines(name, data)])
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


# ---------------------------------------------------------------- the README summary
# (family, row tag, label, against): one README line per results file (device) of the
# family that has rows with that tag, CPU before CUDA. The README keeps the table short:
# tests/package/test_benchmark_report.py checks that the committed results fit MAX_SUMMARY_LINES.
HEADLINES = (
    ("ops", "unique:zipf", "`unique`, Zipf keys", "`torch.unique`"),
    ("ops", "segment_sum", "`segment_sum`", "`index_add_`"),
    ("embedding", "forward", "`embedding_bag` forward (every D, key mix, thread count)", "`nn.EmbeddingBag`"),
    ("bags", "forward_vs_bags", "bags of {bags} ids, forward (every cell)", "`nn.EmbeddingBag` per table"),
    ("bags", "forward_vs_torchrec", "bags of {bags} ids, forward (every cell)",
     "TorchRec `EmbeddingBagCollection`"),
    ("collection", "speedup_vs_torch:w1", "`EmbeddingBagCollection` training step (every config)",
     "`nn.EmbeddingBag` + `SparseAdam`"),
    ("layers", "vs_torch", "`DistributedEmbedding` training step", "`nn.EmbeddingBag` + `SparseAdam`"),
    ("train", "harness", "training harness, samples/s", "`--embedding torch`"),
    ("hashtable", "find", "`HashTable.find` (every load, key mix)", "`torch.searchsorted`"),
)
MAX_SUMMARY_LINES = 15


def summary_value(rows: list[Row]) -> str:
    ratios = [row.ratio for row in rows if row.ratio is not None]
    if not ratios:
        return MISSING
    if len(ratios) == 1:
        only = ratios[0]
        if only.low is None or only.high is None:
            return fmt_ratio(only)
        rounds = f", {only.rounds} rounds" if only.rounds else ""
        return f"{fmt_ratio(only)} ({only.low:.2f}-{only.high:.2f}{rounds})"
    low, high = (f"x{m:.2f}" for m in (min(r.median for r in ratios), max(r.median for r in ratios)))
    return (low if low == high else f"{low} to {high}") + f" (medians of {len(ratios)} cells)"


def _bag_sizes(ids: set) -> str:
    """The bag sizes of a bags line: '10-30', '1 and 10-30'."""
    spans = sorted(ids)
    if not spans or any(len(span) != 2 for span in spans):
        return "many"
    return " and ".join(str(low) if low == high else f"{low}-{high}" for low, high in spans)


def summary_lines(runs: list[Run]) -> list[tuple[str, str, str, str]]:
    """One line per headline and device: the runs of one family on one device (a second
    record of another input shape, say) share it."""
    lines = []
    for family, tag, label, against in HEADLINES:
        by_device: dict = {}
        for run in sorted((r for r in runs if r.family == family and not r.busy), key=run_sort_key):
            rows = [row for row in rows_of(run) if row.tag == tag]
            if rows:
                device = text(run.data.get("device"))
                entry = by_device.setdefault(device, ([], set()))
                entry[0].extend(rows)
                entry[1].update(tuple(r.get("ids_per_bag") or ()) for r in run.data["results"])
        for device, (rows, ids) in by_device.items():
            lines.append((label.format(bags=_bag_sizes(ids)), against, device, summary_value(rows)))
    return lines[:MAX_SUMMARY_LINES]


def render_readme_block(results_dir: str = RESULTS_DIR) -> str:
    """The text that goes between the README's benchmark markers (without the markers)."""
    runs, _ = load_runs(results_dir)
    out = [("Ratios are the competitor's time / sparsekit's time, both run side by side in one "
           "process in interleaved rounds (above 1: sparsekit is faster); one configuration shows "
           "its median (min-max over rounds), several the range of their medians. Every cell, "
           "its command and commit: [docs/benchmarks.md](docs/benchmarks.md)."), ""]
    out += table(("Benchmark", "Against", "Device", "Ratio"), summary_lines(runs))
    return "\n".join(out) + "\n"


def update_readme(readme_text: str, block: str) -> str | None:
    """readme_text with the block between its markers, or None where it has no markers."""
    begin = readme_text.find(README_BEGIN)
    if begin < 0:
        return None
    start = readme_text.find("-->", begin)
    end = readme_text.find(README_END, begin)
    if start < 0 or end < 0:
        raise ReportError(f"README: '{README_BEGIN} ... -->' without a following '{README_END}'")
    start += len("-->")
    return readme_text[:start] + "\n" + block + readme_text[end:]


# ---------------------------------------------------------------- command line
def _read(path: str) -> str | None:
    try:
        with open(path) as handle:
            return handle.read()
    except FileNotFoundError:
        return None


def _shown(path: str) -> str:
    relative = os.path.relpath(path, ROOT)
    return path if relative.startswith("..") else relative


def outputs(results_dir: str, scripts_dir: str, page_path: str, readme_path: str) -> dict[str, str]:
    """Each file the report writes, with its new content (the README only if it has markers)."""
    wanted = {page_path: render_page(results_dir, scripts_dir)}
    readme = _read(readme_path)
    if readme is not None:
        updated = update_readme(readme, render_readme_block(results_dir))
        if updated is not None:
            wanted[readme_path] = updated
    return wanted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if a generated file differs from what would be written")
    parser.add_argument("--results-dir", default=RESULTS_DIR)
    parser.add_argument("--page", default=PAGE_PATH)
    parser.add_argument("--readme", default=README_PATH)
    args = parser.parse_args(argv)
    try:
        wanted = outputs(args.results_dir, SCRIPTS_DIR, args.page, args.readme)
    except ReportError as error:
        print(f"benchmarks.report: {error}", file=sys.stderr)
        return 2
    if args.readme not in wanted:
        print(f"{_shown(args.readme)}: no '{README_BEGIN} ... {README_END}' markers; left alone")
    stale = [path for path, content in sorted(wanted.items()) if _read(path) != content]
    if args.check:
        for path in stale:
            print(f"{_shown(path)} differs from what the benchmark report writes")
        if stale:
            print("run `python -m benchmarks.report` and commit the result")
            return 1
        print("benchmark report up to date")
        return 0
    for path, content in sorted(wanted.items()):
        if path in stale:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as handle:
                handle.write(content)
        print(f"{'wrote' if path in stale else 'unchanged'} {_shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

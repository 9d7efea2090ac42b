"""Reader of Criteo-format TSV files for the training harness.

Each line is ``label \\t I1 .. I13 \\t C1 .. C26``: a 0/1 label, 13 integer (count)
features and 26 categorical values (hex strings in Criteo's release, but any string
is accepted). Any feature may be empty:

* a missing integer feature reads as 0; every integer feature ``x`` then becomes
  ``log(1 + max(x, 0))``, as in DLRM's preprocessing. A count is a plain decimal
  integer: ASCII digits, maybe after a ``-`` (Criteo's data holds a few negative
  counts); ``+5``, `` 5`` or ``1_000``, which Python's ``int()`` reads, are errors.
  Counts are read as float64, so any integer that rounds to a finite float64 is
  accepted (``|x| < 1.8e308``, far beyond int64); a larger one, negative too, is an
  error naming the column (as float64 it would be infinite);
* a missing categorical value gets its slot's "missing" key, the hash of the empty
  string in that slot (one distinct key per slot).

Categorical strings become int64 keys through :mod:`sparsekit.hashing` (XXH3-64,
salted per slot). A line that does not follow the format (wrong number of fields, a
label other than 0/1, a count that is not a plain decimal integer, a count outside the
float64 range) raises :class:`CriteoFormatError` naming the file, the 1-based line
number and the field.

:class:`CriteoTSV` serves a file as a data source of the harness: the last
``eval_samples`` lines (or a separate file) are held out, and global training batch
``step`` is lines ``[step*B, (step+1)*B)`` of the rest, wrapping around at the end (one
pass = one epoch). Batches are a function of ``step`` alone, so resuming needs only the
step, and every world size reads the same global batches; each rank parses only its
own slice of the lines.
"""

from __future__ import annotations

import re
import time
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import xxhash

from .. import hashing
from .._checks import integer_argument, size_argument
from .data import NUM_DENSE, NUM_SLOTS, Batch, SyntheticCriteo, dense_transform, rank_slice

NUM_FIELDS = 1 + NUM_DENSE + NUM_SLOTS
# SyntheticCriteo stream of generated files, apart from its training and eval streams.
_FILE_STREAM = 3


class CriteoFormatError(ValueError):
    """A line of a Criteo TSV file does not follow the format; the message names file:line."""


class LineIndex:
    """Line count of a file and the byte offset of every ``stride``-th line, for seeking.

    One sequential pass at construction (numpy newline search, no parsing).

    Args:
        path: the file.
        stride: lines between two remembered offsets; memory is 8 bytes per ``stride`` lines.
    """

    def __init__(self, path: str, stride: int = 4096, chunk_bytes: int = 1 << 24):
        self.path = path
        self.stride = stride
        offsets: List[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        lines = 0
        position = 0
        last_byte = b"\n"
        with open(path, "rb") as stream:
            while True:
                chunk = stream.read(chunk_bytes)
                if not chunk:
                    break
                ends = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
                # Line (lines + i + 1) starts right after the i-th newline of this chunk.
                starts_line = lines + 1 + np.arange(len(ends))
                keep = starts_line % stride == 0
                offsets.append(position + ends[keep].astype(np.int64) + 1)
                lines += len(ends)
                position += len(chunk)
                last_byte = chunk[-1:]
        if last_byte != b"\n":
            lines += 1  # a last line without a newline
        self.num_lines = lines
        self.size = position
        self._offsets = np.concatenate(offsets)

    def seek(self, stream, line: int) -> None:
        """Position ``stream`` (binary, opened on the same file) at the start of 0-based ``line``."""
        if not 0 <= line <= self.num_lines:
            raise IndexError(f"{self.path}: line {line} out of range [0, {self.num_lines}]")
        anchor = line // self.stride
        stream.seek(int(self._offsets[anchor]))
        for _ in range(line - anchor * self.stride):
            stream.readline()


class CriteoParser:
    """Parses Criteo TSV lines into a :class:`Batch`.

    Args:
        path: file name used in error messages.
        hash_seed: seed of :mod:`sparsekit.hashing`.
    """

    def __init__(self, path: str, hash_seed: int = 0):
        self.path = path
        self.hash_seed = hash_seed
        self._slot_seeds = [hashing.slot_seed(slot, hash_seed) for slot in range(NUM_SLOTS)]
        self._missing = [xxhash.xxh3_64_intdigest(b"", seed) for seed in self._slot_seeds]

    def error(self, line_number: int, message: str) -> CriteoFormatError:
        return CriteoFormatError(f"{self.path}:{line_number}: {message}")

    def parse(self, lines: Sequence[bytes], line_numbers: Sequence[int]) -> Batch:
        """Parse lines (bytes, with or without their newline).

        Args:
            lines: the raw lines.
            line_numbers: 1-based line number of each, for error messages.

        Returns:
            A :class:`Batch` of ``len(lines)`` samples.

        Raises:
            CriteoFormatError: on the first malformed line.
        """
        digest = xxhash.xxh3_64_intdigest
        slot_seeds = self._slot_seeds
        missing = self._missing
        labels: List[bool] = []
        # Flat lists: numpy converts them several times faster than lists of rows.
        dense: List[int] = []
        keys: List[int] = []
        for line, line_number in zip(lines, line_numbers):
            fields = line.rstrip(b"\r\n").split(b"\t")
            if len(fields) != NUM_FIELDS:
                raise self.error(line_number, f"expected {NUM_FIELDS} tab-separated fields (label, "
                                 f"{NUM_DENSE} integers, {NUM_SLOTS} categorical), got {len(fields)}")
            label = fields[0]
            if label == b"0" or label == b"1":
                labels.append(label == b"1")
            else:
                raise self.error(line_number, f"label must be 0 or 1, got {label[:20]!r}")
            counts = fields[1:1 + NUM_DENSE]
            try:
                # int() also reads "+5", " 5" and "1_000": a byte outside digits and "-"
                # sends the line to _count, which says which field is not a plain decimal.
                if b"".join(counts).translate(None, _PLAIN_BYTES):
                    raise ValueError
                dense.extend([int(field) if field else 0 for field in counts])
            except ValueError:
                dense.extend([self._count(line_number, column, field) for column, field in enumerate(counts)])
            keys.extend([digest(field, seed) if field else absent
                         for field, seed, absent in zip(fields[1 + NUM_DENSE:], slot_seeds, missing)])
        count = len(labels)
        # float64 first: counts may exceed the int64 range, and float32 loses nothing that
        # the log transform keeps.
        try:
            raw_dense = np.array(dense, dtype=np.float64).reshape(count, NUM_DENSE)
        except OverflowError:  # an int beyond float64: find it only now, off the fast path
            raise self._overflow(lines, line_numbers, dense) from None
        key_array = np.array(keys, dtype=np.uint64).reshape(count, NUM_SLOTS).view(np.int64)
        return Batch(torch.from_numpy(dense_transform(raw_dense)), torch.from_numpy(key_array),
                     torch.tensor(labels, dtype=torch.float32).reshape(count))

    def _count(self, line_number: int, column: int, field: bytes) -> int:
        """Integer feature ``column`` (0-based) of a line that the fast path could not
        read; raises the CriteoFormatError that says why."""
        if not field:
            return 0
        if not _DIGITS.fullmatch(field):
            raise self.error(line_number, f"integer feature I{column + 1} is not an integer: {field[:20]!r}; a "
                             "count is a plain decimal integer (digits, maybe after a '-')")
        try:
            return int(field)
        except ValueError:
            pass
        # All digits, but more than int() reads (sys.get_int_max_str_digits()): leading
        # zeros aside, that is far beyond float64, whose largest value has 309 digits.
        significant = field.lstrip(b"-").lstrip(b"0")
        if len(significant) > _FLOAT64_DIGITS:
            raise self.error(line_number, _too_large(column, field))
        value = int(significant or b"0")
        return -value if field.startswith(b"-") else value

    def _overflow(self, lines: Sequence[bytes], line_numbers: Sequence[int],
                  dense: List[int]) -> CriteoFormatError:
        """The error for the first count of ``dense`` (flat, NUM_DENSE per line) that
        float64 cannot hold."""
        for position, value in enumerate(dense):
            try:
                float(value)
            except OverflowError:
                row, column = divmod(position, NUM_DENSE)
                field = lines[row].rstrip(b"\r\n").split(b"\t")[1 + column]
                return self.error(line_numbers[row], _too_large(column, field))
        raise AssertionError("float64 conversion overflowed, but no count overflows")


# A count: a plain decimal integer, maybe negative (int() also takes "+", spaces and "_").
_DIGITS = re.compile(rb"-?[0-9]+")
# The bytes of plain decimal counts (the fast path's test: a line with any other byte in its
# counts is read field by field).
_PLAIN_BYTES = b"-0123456789"
# Digits of the largest finite float64, 1.797...e308.
_FLOAT64_DIGITS = 309


def _too_large(column: int, field: bytes) -> str:
    """The message for integer feature ``column`` (0-based) holding ``field``, an integer
    beyond the float64 range."""
    digits = len(field.lstrip(b"+-").lstrip(b"0"))
    shown = f"{field[:20]!r}..." if len(field) > 20 else repr(field)
    what = "too large a negative number" if field.startswith(b"-") else "too large"
    return (f"integer feature I{column + 1} is {what}: {shown} ({digits} digits); counts must lie "
            "within the float64 range, |x| < 1.8e308")


class CriteoTSV:
    """A Criteo TSV file as the harness's data source.

    Args:
        path: the training file.
        eval_samples: held-out samples: the last ``eval_samples`` lines of ``path``, or
            the first ``eval_samples`` lines of ``eval_path`` when given.
        eval_path: optional separate held-out file.
        hash_seed: seed of the categorical feature hashing.

    Raises:
        ValueError: if a file is empty, or no training lines are left after holding out
            ``eval_samples``, or ``eval_samples`` is negative.
        TypeError: ``eval_samples`` not an int.
    """

    def __init__(self, path: str, *, eval_samples: int, eval_path: Optional[str] = None,
                 hash_seed: int = 0):
        # A negative count would make num_train exceed the file (batches read past its end
        # and fail on a line that does not exist); a float broke indexing later.
        eval_samples = size_argument("CriteoTSV", "eval_samples", eval_samples, minimum=0)
        self.path = path
        # Open file and next line number per file read, so sequential batches need no seek.
        self._streams: Dict[str, Tuple[object, int]] = {}
        self._index = LineIndex(path)
        self._parser = CriteoParser(path, hash_seed)
        if self._index.num_lines == 0:
            raise ValueError(f"{path}: empty training file")
        if eval_path is None:
            self.num_train = self._index.num_lines - eval_samples
            if self.num_train <= 0:
                raise ValueError(f"{path}: {self._index.num_lines} lines, not enough to hold out "
                                 f"eval_samples={eval_samples} and train on the rest; lower "
                                 "--eval-samples or pass a separate eval file")
            self._eval = (self._index, self._parser, self.num_train, eval_samples)
        else:
            self.num_train = self._index.num_lines
            eval_index = LineIndex(eval_path)
            if eval_index.num_lines == 0:
                raise ValueError(f"{eval_path}: empty held-out file")
            self._eval = (eval_index, CriteoParser(eval_path, hash_seed), 0,
                          min(eval_samples, eval_index.num_lines))

    def _read(self, index: LineIndex, first: int, count: int) -> List[bytes]:
        """Lines ``[first, first + count)`` of an indexed file, reusing the open stream
        when reading on from where the previous call stopped."""
        stream, next_line = self._streams.get(index.path, (None, -1))
        if stream is None:
            stream = open(index.path, "rb")
        if next_line != first:
            index.seek(stream, first)
        lines = [stream.readline() for _ in range(count)]
        self._streams[index.path] = (stream, first + count)
        return lines

    def train_batch(self, step: int, global_size: int, rank: int = 0, world_size: int = 1) -> Batch:
        """This rank's slice of global training batch ``step``."""
        step = integer_argument("CriteoTSV.train_batch", "step", step)
        _batch_arguments("CriteoTSV.train_batch", global_size, rank, world_size)
        start = (step * global_size) % self.num_train
        lines: List[bytes] = []
        numbers: List[int] = []
        # Wrap around at the end of the training lines, more than once if the file is
        # shorter than a batch.
        while len(lines) < global_size:
            count = min(global_size - len(lines), self.num_train - start)
            lines += self._read(self._index, start, count)
            numbers += range(start + 1, start + count + 1)
            start = 0
        rows = rank_slice(global_size, rank, world_size)
        return self._parser.parse(lines[rows], numbers[rows])

    def eval_batches(self, num_samples: int, global_size: int, rank: int = 0,
                     world_size: int = 1) -> Iterator[Batch]:
        """This rank's slices of the held-out lines (at most ``num_samples``), in global
        batches of ``global_size``."""
        num_samples = size_argument("CriteoTSV.eval_batches", "num_samples", num_samples, minimum=0)
        _batch_arguments("CriteoTSV.eval_batches", global_size, rank, world_size)
        index, parser, first, available = self._eval
        total = min(num_samples, available)
        for start in range(0, total, global_size):
            size = min(global_size, total - start)
            rows = rank_slice(size, rank, world_size)
            lines = self._read(index, first + start, size)
            yield parser.parse(lines[rows], range(first + start + 1, first + start + size + 1)[rows])

    def close(self) -> None:
        for stream, _ in self._streams.values():
            stream.close()
        self._streams.clear()


def _batch_arguments(where: str, global_size: int, rank: int, world_size: int) -> None:
    """A global batch size >= 1 and a rank in ``[0, world_size)`` (else: an empty batch
    without a word, or a ZeroDivisionError)."""
    size_argument(where, "global_size", global_size)
    world_size = size_argument(where, "world_size", world_size)
    rank = size_argument(where, "rank", rank, minimum=0)
    if rank >= world_size:
        raise ValueError(f"{where}: rank must lie in [0, world_size={world_size}), got {rank!r}")


def write_synthetic_tsv(path: str, num_lines: int, seed: int = 0, *, chunk: int = 8192) -> None:
    """Write ``num_lines`` samples of :class:`~sparsekit.train.data.SyntheticCriteo` in
    Criteo's TSV format: missing counts as empty fields, categorical values as 8-digit
    hex strings, and about 2 % of categorical values missing."""
    source = SyntheticCriteo(seed)
    missing_rng = np.random.default_rng([seed, _FILE_STREAM + 1])
    with open(path, "w") as out:
        for index, start in enumerate(range(0, num_lines, chunk)):
            raw_dense, ranks, labels, _ = source.raw(_FILE_STREAM, index, min(chunk, num_lines - start))
            hex_values = source.keys_of(ranks).view(np.uint64) & np.uint64(0xFFFFFFFF)
            missing = missing_rng.random(hex_values.shape) < 0.02
            for label, counts, values, absent in zip(labels, raw_dense, hex_values, missing):
                fields = [str(int(label))]
                fields += ["" if count < 0 else str(count) for count in counts.tolist()]
                fields += ["" if gone else f"{value:08x}" for value, gone in zip(values.tolist(), absent)]
                out.write("\t".join(fields) + "\n")


def benchmark_reader(path: str, batch_size: int = 4096) -> Dict[str, float]:
    """Read and parse a whole file once, batch by batch as the harness does, and time it.

    Returns:
        ``{"lines": N, "seconds": t, "lines_per_s": N / t}``, the index pass included
        (a last partial batch is not read).
    """
    start = time.perf_counter()
    source = CriteoTSV(path, eval_samples=0)
    lines = 0
    for step in range(source.num_train // batch_size):
        lines += len(source.train_batch(step, batch_size))
    source.close()
    seconds = time.perf_counter() - start
    return {"lines": lines, "seconds": seconds, "lines_per_s": lines / seconds}

"""When a one-process step learns of bad input that only the device can see: its error modes.

A step's checks end on the device: the input's verdict (bad offsets), the lookup's report
(a key outside a direct table, bad feature bounds) and the error word its ops record into
(:func:`fresh_error_slots`). :class:`StepErrors` decides when the host reads them:

- ``"raise"`` (the default): once per step, in the forward, before any table changes; a
  failing call raises there and changes nothing.
- ``"late"``: no read of their own. A step that reads the device anyway (one whose tables
  may grow: training with hash tables) raises as ``"raise"`` does. Any other step folds its
  verdict into a device record (the first error is kept), copied to pinned host memory
  behind the step's work; a later forward raises it once the copy has landed (on the CPU:
  the next forward), and :meth:`StepErrors.check` raises it at once. The failing step runs
  on without its bad lookups: they read as zeros and update nothing.
- ``"assert"``: as ``"late"``, but the verdict is a device assert (``torch._assert_async``):
  on a GPU a failure ends the CUDA context, for debugging; on the CPU it raises at once.

Multi-rank steps read the device anyway (the exchange's split sizes) and keep ``"raise"``.
"""

from __future__ import annotations

import bisect
from typing import Any, Callable, List, Optional, Sequence

import torch
from torch import Tensor

from .exchange import _BAD_OFFSETS

__all__ = ["MODES", "StepErrors", "fresh_error_slots", "NO_ERROR"]

MODES = ("raise", "late", "assert")

# The error word's slots hold the first bad bag and the first bad lookup an op of the step met;
# this marks an empty slot (the ops keep the smaller position).
NO_ERROR = 2 ** 63 - 1

# A verdict: [flags, at, absent, bad_bounds, bad_bag, bad_lookup, table, key, nnz]. `flags`
# the input's (0: valid), `at` the first key outside its direct table (nnz: none), `absent`
# how many keys of the tables found directly are missing, `bad_bounds` the lookup's bounds
# check, then the error word; `table` and `key` name `at`'s table and key for a late error.
_WIDTH = 9
_CLEAN = [0, 0, 0, 0, NO_ERROR, NO_ERROR, 0, 0, 0]


def fresh_error_slots(device: torch.device) -> Tensor:
    """An empty error word: int64 ``[2]`` on ``device``."""
    return torch.full((2,), NO_ERROR, dtype=torch.int64, device=device)


def _clean(values: List[int]) -> bool:
    """Whether a verdict read on the host reports no error (csrc/verdict.h's test)."""
    return values[0] == 0 and values[1] >= values[8] and values[3] == 0 and values[4] == NO_ERROR \
        and values[5] == NO_ERROR


@torch.library.register_fake("sparsekit::record_verdict_")
def _record_verdict_fake(record: Tensor, errors: Tensor, clean: Tensor, flags: Tensor, report: Tensor, bounds: Tensor,
                         keys: Tensor, feature_tables: Tensor) -> None:
    torch._check(record.shape == (_WIDTH,) and record.dtype == torch.int64,
                 lambda: f"record_verdict_: record must be int64 [{_WIDTH}], got {record.dtype} {tuple(record.shape)}")
    torch._check(errors.shape == (2,) and errors.dtype == torch.int64, lambda: "record_verdict_: errors must be int64 [2]")
    torch._check(report.shape == (3,) and report.dtype == torch.int64, lambda: "record_verdict_: report must be int64 [3]")
    torch._check(bounds.dim() == 1 and feature_tables.dim() == 1 and bounds.shape[0] == feature_tables.shape[0] + 1,
                 lambda: "record_verdict_: bounds must hold one more entry than feature_tables")
    torch._check(clean.numel() == 1 and clean.dtype == torch.bool, lambda: "record_verdict_: clean must be one bool")


class StepErrors:
    """A collection's error word and the mode in which its steps' verdicts reach the host."""

    def __init__(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"EmbeddingBagCollection: error_mode must be one of {', '.join(map(repr, MODES))}, "
                             f"got {mode!r}")
        self.mode = mode
        self._slots: Optional[Tensor] = None
        self._record: Optional[Tensor] = None   # the first late error, on the device
        self._clean: Optional[Tensor] = None    # whether the record is clean, on the device
        self._host: Optional[Tensor] = None     # its copy in (pinned) host memory
        self._event: Optional[Any] = None       # recorded after that copy (CUDA)
        self._host_values: Any = None
        self._capturing = False                 # the last deferral was captured in a CUDA graph
        self._feature_tables: dict = {}         # device copies of the steps' table-of-feature lists

    def __getstate__(self) -> dict:
        # Copies start with an empty word and record: device state is not the copy's to inherit.
        return {"mode": self.mode}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["mode"])

    def slots(self, device: torch.device) -> Tensor:
        """The step's error word on ``device`` (made once per device)."""
        if self._slots is None or self._slots.device != device:
            self._slots = fresh_error_slots(device)
            if self.mode != "raise":
                self._record = torch.tensor(_CLEAN, dtype=torch.int64, device=device)
                self._clean = torch.ones(1, dtype=torch.bool, device=device)
                self._host = torch.tensor(_CLEAN, dtype=torch.int64, pin_memory=device.type == "cuda")
                self._host_values = self._host.numpy()  # the same memory: read with no torch op
                self._event = None
        return self._slots

    def reads_now(self, may_grow: bool) -> bool:
        """Whether the step reads its verdict at once: always in ``"raise"``; in the other
        modes only where the step must read the device anyway (its tables may grow)."""
        return self.mode == "raise" or may_grow

    def read(self, flags: Tensor, report: Tensor, nnz: int) -> List[int]:
        """The step's verdict read on the host now (the step's one read); the error word is
        emptied where it held an entry, which the caller raises (:func:`raise_verdict`)."""
        values = torch.cat([flags.view(1), report, self.slots(report.device)]).tolist() + [0, 0, nnz]
        if values[4] != NO_ERROR or values[5] != NO_ERROR:
            self._slots.fill_(NO_ERROR)
        return values

    def feature_tables(self, table_of_feature: Sequence[int], device: torch.device) -> Tensor:
        """``table_of_feature`` on ``device``, copied once per distinct list: no copy per step,
        and none from a temporary host buffer that a CUDA graph's replays would read again."""
        key = (tuple(table_of_feature), device)
        tensor = self._feature_tables.get(key)
        if tensor is None:
            if len(self._feature_tables) >= 64:
                self._feature_tables.clear()
            tensor = self._feature_tables[key] = torch.tensor(list(table_of_feature), dtype=torch.int64).to(device)
        return tensor

    def defer(self, flags: Tensor, report: Tensor, bounds: Tensor, keys: Tensor, feature_tables: Tensor) -> None:
        """``"late"`` / ``"assert"``: no read. The verdict is kept on the device (the first
        error wins) and copied to the host behind the step; the error word is emptied."""
        device = report.device
        slots = self.slots(device)
        torch.ops.sparsekit.record_verdict_(self._record, slots, self._clean, flags, report, bounds, keys,
                                            feature_tables)
        if self.mode == "assert":
            try:
                torch._assert_async(self._clean, "sparsekit: a step met bad input (error_mode='assert'); "
                                    "error_mode='raise' names it")
            except RuntimeError:  # the CPU's assert raises here: the record has told its error
                self._clear_record()
                raise
        self._host.copy_(self._record, non_blocking=device.type == "cuda")
        if device.type == "cuda":
            # In a CUDA graph the copy is one of its nodes; nothing polls it (check_errors()).
            self._capturing = torch.cuda.is_current_stream_capturing()
            if not self._capturing:
                self._event = torch.cuda.Event()
                self._event.record()

    def poll(self, raiser: Callable[[List[int]], None]) -> None:
        """Raises (through ``raiser``, given the verdict) a late error whose copy has reached
        the host, without waiting for the device."""
        if self._host is None or self._capturing or (self._event is not None and not self._event.query()):
            return
        self._raise_recorded(self._host_values.tolist(), raiser)

    def check(self, raiser: Callable[[List[int]], None]) -> None:
        """Raises a late error or an error-word entry now, waiting for the device."""
        if self._record is not None:
            self._raise_recorded(self._record.tolist(), raiser)
        if self._slots is not None:
            bag, lookup = self._slots.tolist()
            if bag != NO_ERROR or lookup != NO_ERROR:
                self._slots.fill_(NO_ERROR)
                raise_word(bag, lookup)

    def _raise_recorded(self, values: List[int], raiser: Callable[[List[int]], None]) -> None:
        if _clean(values):
            return
        # What the failing step's own ops recorded since (its pooled read, its update) goes
        # with it: the same bad input.
        self._clear_record()
        self._slots.fill_(NO_ERROR)
        raiser(values)

    def _clear_record(self) -> None:
        """The record and its host copy back to clean, with no copy in flight to wait for."""
        clean = torch.tensor(_CLEAN, dtype=torch.int64)
        self._record.copy_(clean)
        self._host.copy_(clean)
        self._event = None


def raise_word(bad_bag: int, bad_lookup: int) -> None:
    """The error for an error-word entry: ops met input the forward's checks should have stopped."""
    raise RuntimeError(f"sparsekit: an earlier step's pooled read or fused update met bad input (bag {bad_bag}, "
                       f"lookup {bad_lookup}; {NO_ERROR}: none) that its forward's checks should have stopped; "
                       "those lookups were left out of its update")


def raise_verdict(values: List[int], host_bounds: Optional[Sequence[int]], table_of_feature: Sequence[int],
                  bad_input: Callable[[int], None], direct_key_error: Callable[[int, int], BaseException],
                  key_at: Callable[[int], int]) -> None:
    """Raises what a verdict read on the host reports, if anything. ``host_bounds``: the
    step's feature bounds (None for a late verdict, which names its table and key)."""
    flags, at, _, bad_bounds, bad_bag, bad_lookup, table, key, nnz = values
    if bad_bag != NO_ERROR or bad_lookup != NO_ERROR:
        raise_word(bad_bag, bad_lookup)
    bad_input(flags)
    if bad_bounds:  # implies bad offsets, which flags report: never reached with a correct caller
        bad_input(_BAD_OFFSETS)
    if at < nnz:
        if host_bounds is not None:
            table, key = table_of_feature[bisect.bisect_right(host_bounds, at) - 1], key_at(at)
        raise direct_key_error(table, key)

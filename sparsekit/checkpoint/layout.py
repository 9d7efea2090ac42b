"""The on-disk layout of a checkpoint directory and its atomic switch.

A checkpoint directory holds numbered checkpoints ``ckpt-NNNNNN/`` (six digits or more,
the step the caller gave) and ``LATEST``, a file naming the newest complete one. A save
writes ``ckpt-N.tmp/``, flushes it, renames it to ``ckpt-N/`` and only then replaces
``LATEST`` (``os.replace``), so a crash at any moment leaves the checkpoint ``LATEST``
names loadable. :class:`CheckpointDirectory` is the public face of this layout (which
checkpoints exist, which is the latest, pruning old ones); what goes inside a checkpoint
belongs to :mod:`sparsekit.checkpoint.saving`. Every file is written through
:func:`write_file`: flushed to disk, and a failure is an OSError naming the file.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from typing import Iterable, List, Optional

__all__ = ["CheckpointDirectory", "LATEST", "checkpoint_name", "file_in_the_way", "nearest_existing",
           "write_file"]

LATEST = "LATEST"
_CHECKPOINT_NAME = re.compile(r"^ckpt-(\d{6,})$")
# Steps are int64 counters (a training step); the name's digits are that number's.
_MAX_STEP = (1 << 63) - 1


def checkpoint_name(step: int) -> str:
    """The directory name of checkpoint ``step``: ``ckpt-`` and at least six digits."""
    return f"ckpt-{step:06d}"


def check_step(caller: str, step: object) -> int:
    """``step`` when it is an int in [0, 2**63); a TypeError or ValueError naming it otherwise."""
    if not isinstance(step, int) or isinstance(step, bool):
        raise TypeError(f"{caller}: step must be an int, got {type(step).__name__}")
    if not 0 <= step <= _MAX_STEP:
        raise ValueError(f"{caller}: step must lie in [0, 2**63), got {step}")
    return step


def nearest_existing(directory: str) -> Optional[str]:
    """``directory`` if it exists, else its nearest ancestor that does (a file included); None if none."""
    path = os.path.abspath(directory)
    while not os.path.exists(path):  # False under a file too (ENOTDIR): look at the parents
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return path


def file_in_the_way(directory: str) -> Optional[str]:
    """The file that ``directory`` is, or lies under, so that it cannot be a directory; None if none."""
    path = nearest_existing(directory)
    return None if path is None or os.path.isdir(path) else path


def check_not_a_file(directory: str, caller: str, fix: str) -> None:
    """Raises NotADirectoryError naming ``directory`` (and the file in the way) when it
    cannot be a directory; the OS error would name only ``LATEST`` under it."""
    blocker = file_in_the_way(directory)
    if blocker is None:
        return
    where = "is a file" if blocker == os.path.abspath(directory) else f"lies under {blocker!r}, which is a file"
    raise NotADirectoryError(f"{caller}: directory {directory!r} {where}; {fix}")


def write_file(path: str, write) -> None:
    """Writes ``path`` through ``write(file)`` and flushes it to disk. A failed write is an
    OSError naming ``path``: also one from a flush or fsync (a full disk: an errno, no file
    name), and torch.save's zip writer's, which it raises as a RuntimeError."""
    try:
        with open(path, "wb") as out:
            write(out)
            out.flush()
            os.fsync(out.fileno())
    except OSError as error:
        if error.filename is not None:
            raise
        raise OSError(error.errno, error.strerror or str(error), path) from error
    except RuntimeError as error:
        text = str(error)
        if "PytorchStreamWriter" not in text and "inline_container" not in text:
            raise
        first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
        raise OSError(errno.EIO, f"torch.save could not write the file ({first}); is the disk full?",
                      path) from error


def fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:  # named, as write_file's
        raise OSError(error.errno, error.strerror or str(error), path) from error
    finally:
        os.close(fd)


class CheckpointDirectory:
    """A directory of numbered checkpoints ``ckpt-NNNNNN/`` and the ``LATEST`` pointer.

    Reading it (:meth:`latest`, :meth:`steps`) and :meth:`prune` are local: call them on
    one process, or on each, as the caller's protocol needs. :func:`save_checkpoint` and
    :func:`load_checkpoint` take the same path; a save goes through :meth:`prepare` and
    :meth:`commit` (rank 0 only), which callers do not need.
    """

    def __init__(self, path: str) -> None:
        self.path = os.fspath(path)

    def __repr__(self) -> str:
        return f"CheckpointDirectory({self.path!r})"

    @staticmethod
    def owns(name: str) -> bool:
        """Whether an entry called ``name`` directly in a checkpoint directory belongs to
        the layout (a save replaces or removes it): ``LATEST``, ``ckpt-N`` and their
        temporaries."""
        base = name[:-len(".tmp")] if name.endswith(".tmp") else name
        return base == LATEST or bool(_CHECKPOINT_NAME.match(base))

    def checkpoint(self, step: int) -> str:
        """The path of checkpoint ``step`` (whether or not it exists)."""
        return os.path.join(self.path, checkpoint_name(check_step("CheckpointDirectory.checkpoint", step)))

    def steps(self) -> List[int]:
        """The steps of the ``ckpt-N`` directories present, ascending ([] when the directory
        does not exist); complete or not: only ``LATEST`` says which one is whole."""
        if not os.path.isdir(self.path):
            return []
        return sorted(int(match.group(1)) for name in os.listdir(self.path)
                      if (match := _CHECKPOINT_NAME.match(name)) and os.path.isdir(os.path.join(self.path, name)))

    def latest(self) -> Optional[str]:
        """The path of the checkpoint ``LATEST`` names; None when there is no ``LATEST``.

        Raises:
            ValueError: ``LATEST`` cannot be read, is empty, holds no checkpoint's name,
                or names a directory that does not exist (the message names the file).
        """
        pointer = os.path.join(self.path, LATEST)
        try:
            with open(pointer, "rb") as file:
                content = file.read(256)  # a checkpoint's name is short; more is not one
        except FileNotFoundError:
            return None
        except OSError as error:
            raise ValueError(f"cannot read {pointer} ({error.strerror or error}); it should hold the name of "
                             f"the newest checkpoint of {self.path}") from None
        fix = (f"it should hold the name of the newest checkpoint (ckpt-NNNNNN) of {self.path}; correct it, or "
               "delete it to start afresh")
        name = content.decode("ascii", errors="replace").strip()
        if not name:
            raise ValueError(f"{pointer} is empty; {fix}")
        if not _CHECKPOINT_NAME.match(name):
            raise ValueError(f"{pointer} holds {content[:40]!r}, not a checkpoint's name; {fix}")
        if not os.path.isdir(os.path.join(self.path, name)):
            raise ValueError(f"{pointer} names {name}, but {self.path} has no directory {name}; {fix}")
        return os.path.join(self.path, name)

    def latest_step(self) -> Optional[int]:
        """The step of :meth:`latest`, or None; raises as :meth:`latest`."""
        path = self.latest()
        return None if path is None else int(_CHECKPOINT_NAME.match(os.path.basename(path)).group(1))

    def next_step(self) -> int:
        """The step a save given none writes: one more than the one ``LATEST`` names, read
        by name only (1 without ``LATEST``, or when it holds no checkpoint's name)."""
        try:
            with open(os.path.join(self.path, LATEST)) as pointer:
                match = _CHECKPOINT_NAME.match(pointer.read().strip())
        except (FileNotFoundError, UnicodeDecodeError):
            return 1
        return int(match.group(1)) + 1 if match else 1

    def prune(self, keep: int, newest_first: Iterable[int] = ()) -> List[int]:
        """Removes all but the ``keep`` newest checkpoints; returns the steps removed.

        Step numbers say nothing about age (a fresh run into a directory a longer run used
        writes lower steps after higher ones). Newest are: the steps in ``newest_first``,
        in that order, then the others by the modification time of their directory (when
        its last file was written), the higher step first on a tie. The one ``LATEST``
        names is never removed. Local: call it on one process.
        """
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"CheckpointDirectory.prune: keep must be an int >= 1, got {keep!r}")
        rank = {step: position for position, step in enumerate(newest_first)}
        try:
            latest = self.latest_step()
        except ValueError:
            latest = None

        def age(step: int) -> tuple:  # smaller is newer
            try:
                modified = os.stat(self.checkpoint(step)).st_mtime_ns
            except OSError:  # vanished meanwhile: the oldest
                modified = -1
            return (rank.get(step, len(rank)), -modified, -step)

        removed = [step for step in sorted(self.steps(), key=age)[keep:] if step != latest]
        for step in removed:
            shutil.rmtree(self.checkpoint(step), ignore_errors=True)
        return removed

    def prepare(self, step: int) -> str:
        """Creates (empty) the temporary directory that save ``step`` writes into; its path."""
        temp_dir = self.checkpoint(step) + ".tmp"
        os.makedirs(self.path, exist_ok=True)
        shutil.rmtree(temp_dir, ignore_errors=True)  # a crashed save's leftovers
        os.makedirs(temp_dir)
        return temp_dir

    def commit(self, step: int, keep: Optional[int]) -> str:
        """Makes the written checkpoint ``step`` the latest: rename its directory, then
        replace ``LATEST``; then keep the ``keep`` newest checkpoints (all when None)."""
        name = checkpoint_name(step)
        final_dir = os.path.join(self.path, name)
        temp_dir = final_dir + ".tmp"
        fsync_directory(temp_dir)
        pointer = os.path.join(self.path, LATEST)
        if os.path.isdir(final_dir):
            # Written by a save that crashed before LATEST moved, or (the step LATEST names)
            # the checkpoint this save replaces: LATEST goes first, so a crash now leaves no
            # pointer rather than one naming a directory that is gone or half-swapped.
            try:
                if self.latest_step() == step:
                    os.remove(pointer)
                    fsync_directory(self.path)
            except ValueError:
                pass
            shutil.rmtree(final_dir, ignore_errors=True)
        os.replace(temp_dir, final_dir)
        fsync_directory(self.path)
        latest_temp = pointer + ".tmp"
        write_file(latest_temp, lambda f: f.write(name.encode()))
        os.replace(latest_temp, pointer)
        fsync_directory(self.path)
        if keep is not None:
            self.prune(keep, (step,))
        return final_dir

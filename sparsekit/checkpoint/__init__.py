"""Collective, atomic, world-size-independent checkpoints of models with sharded embeddings.

Layout of a checkpoint directory (see :class:`CheckpointDirectory`)::

    LATEST                        name of the newest complete checkpoint (replaced atomically)
    ckpt-000007/                  one checkpoint, numbered by the caller's step
        metadata.json             format, world size, the embedding layers and their shapes (and
                                  a collection's tables' names: they load by name)
        dense.pt                  rank 0: dense parameters/buffers + their optimizer state
        shard-00000-of-00002.pt   rank r: per embedding layer, the keys it owns, their rows,
        shard-00001-of-00002.pt   their per-row optimizer state (exp_avg, ...) and the step
        (extra files)             whatever each rank passed as ``extra`` (e.g. a trainer's state)

Each shard file maps every embedding layer's name to that rank's part: ``keys`` (int64
``[n]``), ``weight`` (``[n, dim]``), ``state`` (per-row optimizer state, each ``[n, dim]``),
``scalars`` (the rest of its optimizer state, e.g. ``step``), ``has_state`` and, for a
hash-table layer, ``dynamic``: ``last_seen`` and ``count`` (int64 ``[n]``, the keys'
scores), ``clock``, ``evicted``, ``admitted``, ``pending`` (the keys waiting for admission,
with their scores and clock) and, with eviction, ``fresh`` (bool ``[n]``: the key took an
evicted key's row since its last optimizer update, so its saved moments are still the
evicted key's and are reset at its next update). A checkpoint without ``fresh`` loads with
no reset pending; a layer without eviction that loads one resets those keys' moments at
once.

Every file is plain tensors, ints, floats and strings: ``torch.load(weights_only=True)``
reads it, nothing is unpickled as code. A save writes ``ckpt-N.tmp/`` and, once every rank
reports success, renames it to ``ckpt-N/`` and only then points ``LATEST`` at it
(``os.replace``), so a crash at any moment leaves the previous checkpoint loadable.

Rows are saved by key, so a checkpoint saved on N ranks loads on M ranks: every rank reads
every shard file and keeps the keys it owns under the new world size (``uint64(k) % M``).
Hash tables are rebuilt with the saved keys in the saved row order, so loading on the same
world size restores the same rows bit for bit. The directory must be visible to every
rank (one machine or a shared file system).

Modules, one concern each: :mod:`.layout` (the directory layout and its atomic switch),
:mod:`.collective` (agreement across ranks), :mod:`.model_state` (names, layers and dense
state of a model), :mod:`.saving` (the payload written), :mod:`.reading` (reading and
checking the files), :mod:`.loading` (resharding and restoring).
"""

from .collective import OtherRankError
from .layout import LATEST, CheckpointDirectory
from .loading import load_checkpoint
from .model_state import FORMAT_VERSION
from .saving import save_checkpoint

__all__ = ["CheckpointDirectory", "FORMAT_VERSION", "LATEST", "OtherRankError", "load_checkpoint", "save_checkpoint"]


"""Spawned gloo process groups on loopback for the multi-rank layer and checkpoint tests."""

from __future__ import annotations

import datetime
import gc
import os
import sys
import uuid
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# A rank that stops answering fails its peers' collectives after this long instead of hanging.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


def _entry(rank: int, fn: Callable[..., Any], world_size: int, store_path: str, args: tuple) -> None:
    torch.set_num_threads(1)  # the ranks share a couple of cores
    fn(rank, world_size, lambda: init_gloo(rank, world_size, store_path), *args)
    if dist.is_initialized():
        # Tearing gloo down while a peer still finishes its last collective aborts that
        # peer now and then ("terminate called without an active exception"): wait for
        # every rank first (as the harness does).
        dist.barrier()
        dist.destroy_process_group()
    # A rank that passed is done: leave without the interpreter's finalisation, where
    # gloo objects that a stray reference kept alive are destroyed with the interpreter
    # half gone and abort the process now and then. A failing rank raised above, and
    # spawn reports its traceback as usual.
    gc.collect()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def init_gloo(rank: int, world_size: int, store_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)


def spawn(fn: Callable[..., Any], world_size: int, tmp_dir: str, *args: Any) -> None:
    """Runs ``fn(rank, world_size, init, *args)`` on ``world_size`` processes.

    ``fn`` must be a module-level function; it calls ``init()`` to join the gloo group
    (a FileStore under ``tmp_dir``), so it can compute one-process references first. An
    exception on any rank fails the test with that rank's traceback.
    """
    store_path = os.path.join(tmp_dir, f"store-{uuid.uuid4().hex}")
    mp.spawn(_entry, args=(fn, world_size, store_path, args), nprocs=world_size, join=True)

"""What a worker runs for one index batch of a map-style dataset.

The callable travels inside the registered pipeline (cloudpickled, so a dataset or collate_fn
defined in the training script's `__main__` goes by value) and runs in the worker's executor
processes. Fetching is torch's own `_MapDatasetFetcher`, so `__getitems__`, auto-collation and
`batch_size=None` (no batching: `collate_fn(dataset[i])`) behave exactly as in torch's workers.

Each batch is made as torch's worker `position % num_workers` would make it (its WorkerInfo,
`worker_init_fn` run first in each process), with the RNGs seeded for that batch alone as torch
seeds a worker, `base_seed + position` (worker_context.py): the same seed gives the same
augmentations whichever executor makes the batch. A worker's first batch starts from the RNG
states its `worker_init_fn` left, so the first `num_workers` batches of an epoch get exactly
torch's, also when `worker_init_fn` seeds. An exception becomes a `BatchError` element, so the
epoch goes on with the next batch as torch's does.

The dataset, collate_fn and worker_init_fn are pickled together (`DatasetCopies`), so a
worker_init_fn that is a method of the dataset configures the copy that makes the batches.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.utils.data._utils.fetch import _MapDatasetFetcher

from torch_dataservice.errors import RemoteError, describe_exception
from torch_dataservice.pipeline import pickling
from torch_dataservice.pipeline.shared_objects import SharedObjectRef
from torch_dataservice.torch.worker_context import (
    RngStates,
    as_torch_worker,
    plain_collate,
    round_seed,
    worker_info,
)

_init_lock = threading.Lock()
_copy_lock = threading.Lock()


@dataclass(frozen=True)
class BatchError:
    """An exception raised while making one batch, carried to the trainer in its place."""

    remote_type: str
    message: str
    traceback: str

    @classmethod
    def of(cls, error: BaseException) -> BatchError:
        return cls(*describe_exception(error))

    def error(self) -> RemoteError:
        """The exception to raise on the trainer (of the remote type where it exists here)."""
        return RemoteError(self.remote_type, self.message, self.traceback)


@dataclass(frozen=True)
class EpochSeeds:
    """What an epoch's batches are seeded from, as torch's DataLoader iterator would.

    `base_seed`: drawn per `iter()` (persistent workers: once; `round` counts their epochs).
    Seeds go by global batch number `(first + position) * stride + offset` (ranks interleave),
    so two ranks sharing a base seed never draw alike; `first` is the batch a resumed epoch's
    remainder starts at (its batches are seeded as the same batches of an uninterrupted run).
    """

    base_seed: int
    round: int = 0
    num_workers: int = 0
    stride: int = 1
    offset: int = 0
    first: int = 0


class FetchBatch:
    """`(position, index_batch) -> (position, collate_fn([dataset[i] for i in index_batch]))`."""

    def __init__(self, dataset: Any, auto_collation: bool, collate_fn: Callable[[Any], Any],
                 worker_init_fn: Callable[[int], None] | None = None) -> None:
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn
        self.worker_init_fn = worker_init_fn

    def __getstate__(self) -> dict:
        return {"dataset": self.dataset, "auto_collation": self.auto_collation,
                "collate_fn": self.collate_fn, "worker_init_fn": self.worker_init_fn}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __call__(self, item: tuple[int, Any], seeds: EpochSeeds | None = None) -> tuple[int, Any]:
        position, index = item
        if seeds is None:
            return position, self._fetcher().fetch(index)
        number = seeds.first + position  # the batch's number in this rank's whole epoch
        try:
            info, rng = None, None
            if seeds.num_workers > 0:
                info = worker_info(number % seeds.num_workers, seeds.num_workers,
                                   seeds.base_seed, self.dataset)
                after_init = self._init_worker(info, seeds)
                if number == info.id and seeds.round == 0:  # the worker's first batch
                    rng = after_init
            if rng is None:
                rng = RngStates.seeded(round_seed(seeds.base_seed, seeds.round),
                                       number * seeds.stride + seeds.offset)
            with as_torch_worker(info, rng, keep=False):  # a batch's RNGs end with it
                return position, self._fetcher().fetch(index)
        except Exception as error:
            return position, BatchError.of(error)

    def _fetcher(self) -> _MapDatasetFetcher:
        fetcher = self.__dict__.get("_made_fetcher")
        if fetcher is None:
            fetcher = self.__dict__["_made_fetcher"] = _MapDatasetFetcher(
                self.dataset, self.auto_collation, plain_collate(self.collate_fn), False)
        return fetcher

    def _init_worker(self, info: Any, seeds: EpochSeeds) -> RngStates | None:
        """worker_init_fn(id) once per worker id in this process: per epoch, or once for
        persistent workers (whose base seed stays), from the RNG states of that worker's first
        batch; returns where it left them (None without one, or when it failed). As in torch, a
        failure is the error of that worker's first batch, and later batches go on."""
        if self.worker_init_fn is None:
            return None
        key = (seeds.base_seed, info.id)
        # The replicas of several tasks may share this object, as threads: one runs the init,
        # the others wait for the states it leaves.
        with _init_lock:
            done = self.__dict__.setdefault("_initialized", {})
            if key in done:
                return done[key]
            done[key] = None
            rng = RngStates.seeded(seeds.base_seed, info.id * seeds.stride + seeds.offset)
            with as_torch_worker(info, rng):
                self.worker_init_fn(info.id)
            done[key] = rng
            return rng


class DatasetCopies:
    """A loader's FetchBatch, pickled once, from which executor processes make their copies
    as torch's workers get theirs: a fresh copy for every epoch (`iter()`), or with
    persistent workers one copy per process for the loader's life. `owner` (persistent
    workers only) names the loader, so that two loaders over equal datasets never share one.

    Registered as a shared object (pipeline/shared_objects.py): its bytes travel to an executor
    process once, not once per epoch.
    """

    def __init__(self, fetch: FetchBatch, owner: str | None) -> None:
        self.data = pickling.dumps(fetch)  # names an attribute that cannot be pickled
        self.owner = owner

    def __getstate__(self) -> dict:
        return {"data": self.data, "owner": self.owner}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def copy(self) -> FetchBatch:
        if self.owner is None:
            return pickle.loads(self.data)
        with _copy_lock:  # the replicas of the loader's epochs share this object, as threads
            kept = self.__dict__.get("_kept")
            if kept is None:
                kept = self.__dict__["_kept"] = pickle.loads(self.data)
                self.data = b""  # never unpickled again here
            return kept


class SharedFetchBatch:
    """An epoch's batches made through the loader's `DatasetCopies` (registered once as a
    shared object, referred to by `source`) with this epoch's seeds.

    An epoch's pipeline holds this instead of the FetchBatch itself, so the dataset travels
    once per executor process, not once per epoch (pipeline/shared_objects.py); each executor
    process unpickles the epoch's pipeline once, and so makes one copy per epoch.
    """

    def __init__(self, source: SharedObjectRef, seeds: EpochSeeds | None = None) -> None:
        self.source = source
        self.seeds = seeds

    def __getstate__(self) -> dict:
        return {"source": self.source, "seeds": self.seeds}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __call__(self, item: tuple[int, Any]) -> tuple[int, Any]:
        fetch = self.__dict__.get("_copy")
        if fetch is None:
            source = self.source
            if isinstance(source, SharedObjectRef):
                raise RuntimeError(f"{source!r} is only resolved in a worker's executor")
            fetch = self.__dict__["_copy"] = source.copy()  # one replica's thread calls this
        return fetch(item, self.seeds)

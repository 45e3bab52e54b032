"""An iterable dataset read as torch reads it with `num_workers` worker processes.

torch gives each of its `num_workers` workers a copy of the dataset and a WorkerInfo, and each
worker batches its own stream; an IterableDataset that shards itself by worker info yields
each element once, one that does not yields one replica per worker. Here worker k of N is
shard k, one DYNAMIC split of the pipeline `from_items(range(N)).flat_map(RunShard(...))`: the
dispatcher hands each shard to one executor process, which runs it as torch's worker k would
(a fresh copy of the dataset, its WorkerInfo, its RNG stream seeded `base_seed + k`,
`worker_init_fn(k)` first), so the elements, batches and augmentations are torch's. The
dataset, collate_fn and worker_init_fn are pickled together, so a worker_init_fn that is a
method of the dataset configures the shard's copy. A
process runs one shard of a loader at a time, so ids are unique among the processes serving
the loader; with more executor processes than N, the others have no part in it.

Each batch travels as `(k, j, batch)` (its shard and place in it) and each shard ends with
`(k, j, SHARD_END)`, so the trainer can interleave them as torch does (round-robin over the
shards still running: loader_iter.py).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data._utils.fetch import _IterableDatasetFetcher

from torch_dataservice.pipeline import pickling
from torch_dataservice.torch.fetch import BatchError, EpochSeeds
from torch_dataservice.torch.worker_context import (
    RngStates,
    as_torch_worker,
    plain_collate,
    round_seed,
    worker_info,
)


class ShardEnd:
    """Marks the end of one shard's batches."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ShardEnd)

    def __hash__(self) -> int:
        return 0


SHARD_END = ShardEnd()


class RunShard:
    """`k -> (k, j, batch) ...`: what torch's worker k of `seeds.num_workers` yields."""

    def __init__(self, dataset: Any, seeds: EpochSeeds, auto_collation: bool,
                 collate_fn: Callable[[Any], Any], drop_last: bool, batch_size: int | None,
                 end_markers: bool, worker_init_fn: Callable[[int], None] | None = None) -> None:
        # Pickled here (an error names what cannot be pickled): every shard unpickles its own
        # copy, as torch's workers get theirs.
        self.worker_bytes = pickling.dumps(
            {"dataset": dataset, "collate_fn": collate_fn, "worker_init_fn": worker_init_fn})
        self.seeds = seeds
        self.auto_collation = auto_collation
        self.drop_last = drop_last
        self.batch_size = batch_size
        self.end_markers = end_markers

    def __call__(self, shard: int) -> Iterator[tuple[int, int, Any]]:
        seeds = self.seeds
        worker = pickle.loads(self.worker_bytes)
        dataset, worker_init_fn = worker["dataset"], worker["worker_init_fn"]
        num_workers = max(1, seeds.num_workers)
        base_seed = round_seed(seeds.base_seed, seeds.round)
        # num_workers=0: torch reads in the main process, where get_worker_info() is None.
        info = (worker_info(shard, num_workers, base_seed, dataset) if seeds.num_workers > 0
                else None)
        rng = RngStates.seeded(base_seed, shard)
        fetcher: _IterableDatasetFetcher | None = None
        position = 0
        with as_torch_worker(info, rng):
            try:
                if worker_init_fn is not None and info is not None:
                    worker_init_fn(shard)
                fetcher = _IterableDatasetFetcher(dataset, self.auto_collation,
                                                  plain_collate(worker["collate_fn"]),
                                                  self.drop_last)
            except Exception as error:  # torch: the worker's first result is this error
                failed: Any = BatchError.of(error)
        if fetcher is None:
            yield shard, position, failed
            position += 1
        else:
            for batch in self._batches(fetcher, info, rng):
                yield shard, position, batch
                position += 1
        if self.end_markers:
            yield shard, position, SHARD_END

    def _batches(self, fetcher: _IterableDatasetFetcher, info: Any,
                 rng: RngStates) -> Iterator[Any]:
        """torch's worker loop for one shard: fetch until the stream ends; an exception is that
        batch's result and the next fetch goes on (a generator that raised is over then)."""
        index = [None] * self.batch_size if self.auto_collation and self.batch_size else None
        while True:
            with as_torch_worker(info, rng):
                try:
                    batch = fetcher.fetch(index)
                except StopIteration:
                    return
                except Exception as error:
                    batch = BatchError.of(error)
            yield batch

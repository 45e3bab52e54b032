"""`tds.DataLoader`: torch's DataLoader, with the batches made by the service's workers.

Map-style datasets (the common case): every epoch the loader draws its index batches on the
trainer exactly as torch would (`sampling.py`), numbers them, and registers the pipeline
`from_items([(position, index_batch), ...]).with_split_size(1).map(SharedFetchBatch(ref))`:
each index batch is one split, handed out by the dispatcher (DYNAMIC) to whichever worker
process asks next, which runs `collate_fn([dataset[i] for i in index_batch])`. The dataset and
collate_fn (a `FetchBatch`) are registered apart, as a shared object that `ref` names
(pipeline/shared_objects.py): workers fetch and unpickle it once, not every epoch. It is pickled
again each epoch to notice a dataset that changed (as torch's non-persistent workers would see
it) and registered again only then; with `persistent_workers=True` it is pickled once, as
torch's persistent workers keep their first copy. A small reorder buffer
keyed by position restores torch's order (`in_order=True`); it stays small because splits are
handed out in order, so only batches overtaken by a slower one wait. The epoch's dataset is
registered as ephemeral: the dispatcher forgets it once its iteration is garbage-collected.

Under torchrun every rank draws the same global batch list from the same seed (no
communication) and registers its own part: batch b goes to rank b % world_size, and with
`even_batches` the batch list is first cut to a multiple of world_size, so every rank yields
the same number of batches and DDP cannot hang at the end of an epoch. With the default
samplers this is exactly `DistributedSampler(drop_last=True)` + `BatchSampler`: at most
world_size - 1 samples are dropped per epoch. With a user's sampler or batch_sampler the
global batches are dealt out, so at most world_size - 1 batches are dropped. A
`DistributedSampler` passed by the user already splits by rank and is used as it is.

Iterable datasets and Pipelines run on the workers as they are (batched there with torch's
collation rules); the order is whatever the service gives. Under torchrun all ranks read one
shared job with coordinated reads (rank = consumer index): in each step all ranks get
consecutive batches of the same worker, and the job ends at the same step for every rank.

`state_dict()` / `load_state_dict()` follow torchdata's StatefulDataLoader: a loader restored
from a state taken after k batches of an epoch re-draws that epoch and registers only the
batches after the first k.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import torch
import torch.utils.data
from torch.utils.data import IterableDataset

from torch_dataservice.client.api import (
    ReadOptions,
    ShardingPolicy,
    dataset_def,
    from_dataset_id,
    register_dataset,
    register_definition,
    shared_object_def,
)
from torch_dataservice.observability.client import ClientStats, feeding
from torch_dataservice.pipeline import Pipeline
from torch_dataservice.pipeline.shared_objects import SharedObjectRef
from torch_dataservice.torch import embedded, sampling
from torch_dataservice.torch.distributed import RankInfo, broadcast_token, rank_info, run_seed
from torch_dataservice.torch.fetch import FetchBatch, SharedFetchBatch
from torch_dataservice.torch.loader_stats import even_batches_loss

logger = logging.getLogger(__name__)

STATE_KEYS = ("epoch", "batches_yielded", "in_progress", "rng", "base_seed", "seeded",
              "rank", "world_size")
_POLL_S = 0.1
_iterable_loaders = itertools.count()  # names the shared jobs of iterable loaders under DDP


class DataLoader(torch.utils.data.DataLoader):
    """A drop-in for `torch.utils.data.DataLoader` fed by the service.

    Takes torch's arguments (same positions) and yields the same batches; `num_workers`,
    `prefetch_factor`, `persistent_workers`, `worker_init_fn` and `multiprocessing_context` are
    checked as torch checks them and otherwise ignored: the service's workers do the work.
    Keyword-only extras:

    - `service`: `"grpc://HOST:PORT"`; None reads `TORCH_DATASERVICE_ADDRESS`, and if that is
      unset starts a dispatcher and a worker in this process (`embedded.py`).
    - `processing_mode`: how the service divides the work. The default, DYNAMIC
      ("distributed_epoch"), makes each batch once; the others keep tf.data service's meaning
      ("parallel_epochs": every worker makes the whole epoch) and yield in arrival order. An
      iterable dataset that is not a splittable Pipeline is read with "parallel_epochs".
    - `job_name`: loaders with the same name share each epoch's batches, first come first
      served (then batches come in arrival order). Under torchrun an iterable dataset's ranks
      share one job anyway; a `job_name` given there names it (all ranks must pass the same).
    - `even_batches`: under torchrun, every rank yields the same number of batches.
    - `compression`, `max_outstanding_requests`: as in `tds.distribute`.

    The dataset and `collate_fn` travel to the workers with cloudpickle (by value when they are
    defined in the training script), once, or again in an epoch where their pickle changed;
    each executor process of a worker unpickles one copy, shared by its threads.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        service: Any = None,
        processing_mode: Any = "distributed_epoch",
        job_name: str | None = None,
        even_batches: bool = True,
        compression: str | None = "AUTO",
        max_outstanding_requests: int | None = None,
    ) -> None:
        _check_worker_arguments(num_workers, prefetch_factor, persistent_workers)
        # torch validates everything else (sampler/shuffle/batch_sampler/drop_last conflicts,
        # iterable datasets with samplers) and resolves the samplers and collate_fn; with no
        # worker processes of its own.
        super().__init__(
            dataset, batch_size, shuffle, sampler, batch_sampler, 0, collate_fn, False,
            drop_last, timeout, None, None, generator, prefetch_factor=None,
            persistent_workers=False, pin_memory_device=pin_memory_device, in_order=in_order)
        self.num_workers = num_workers
        self.prefetch_factor = 2 if num_workers > 0 and prefetch_factor is None \
            else prefetch_factor
        self.pin_memory = pin_memory
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context  # torch's setter checks it
        object.__setattr__(self, "persistent_workers", persistent_workers)  # torch guards it

        # Validated now, before any contact with the service.
        options = ReadOptions.build(processing_mode, service or "localhost:0", job_name, None,
                                    None, max_outstanding_requests, None, "AUTO")
        if compression not in ("AUTO", None):
            raise ValueError(f"compression must be 'AUTO' or None, got {compression!r}")
        self._tds_policy = options.policy
        self._tds_service, self._tds_embedded = embedded.resolve(service)
        self._tds_job_name = job_name
        self._tds_compression = compression
        self._tds_max_outstanding = max_outstanding_requests
        self._tds_even = bool(even_batches)

        self._tds_iterable = isinstance(self.dataset, IterableDataset)
        self._tds_default_sampling = sampler is None and batch_sampler is None
        self._tds_shuffle = bool(shuffle)
        self._tds_ranks: RankInfo = rank_info()
        self._tds_split = (self._tds_ranks.distributed and not self._tds_iterable
                           and not sampling.splits_by_rank(self))
        if self._tds_iterable and self._tds_ranks.distributed and self._tds_embedded:
            raise ValueError(
                "under torch.distributed an iterable dataset or Pipeline is read as one job "
                "shared by all ranks, which needs one service for all of them: pass "
                "service='grpc://HOST:PORT' or set TORCH_DATASERVICE_ADDRESS")
        self._tds_loader_number = next(_iterable_loaders) if self._tds_iterable else -1
        self._tds_token: str | None = None
        self._tds_passes = 0
        # (service, fingerprint, dataset id) of the FetchBatch registered as a shared object.
        self._tds_shared: tuple[str, str, str] | None = None

        # Epochs. Seeded: an epoch's draw is a function of (base seed, epoch), as with
        # DistributedSampler; otherwise the loader draws exactly as torch's, from the
        # generators' current state.
        if generator is not None:
            self._tds_base_seed: int | None = generator.initial_seed()
        elif self._tds_ranks.distributed:
            self._tds_base_seed = run_seed()
        else:
            self._tds_base_seed = None  # drawn from torch's global RNG by the first set_epoch
        self._tds_seeded = self._tds_split
        self._tds_next_epoch = 0
        self._tds_pending: dict[str, Any] | None = None  # a restored state, until iter()
        self._tds_progress: _Progress | None = None
        self._tds_stats = ClientStats(rank=self._tds_ranks.rank)  # see stats()

    def stats(self) -> dict[str, Any]:
        """What this loader took and waited for, over its life: batches, elements and bytes
        received, seconds `__next__` blocked, per worker; and per epoch the samples (or, with
        a custom sampler, batches) `even_batches` dropped or padded."""
        return self._tds_stats.as_dict()

    # ------------------------------------------------------------------------ epochs

    def set_epoch(self, epoch: int) -> None:
        """Make the next `iter()` epoch `epoch`, shuffled as `DistributedSampler.set_epoch`
        would (seed = the generator's initial seed, or one shared by the run's ranks)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        if self._tds_base_seed is None:
            self._tds_base_seed = int(torch.empty((), dtype=torch.int64).random_().item())
        seen: set[int] = set()
        # Samplers that reshuffle per epoch (DistributedSampler), and datasets that do (an
        # iterable dataset's set_epoch): the dataset travels to the workers with each epoch.
        for target in (self.sampler, self.batch_sampler,
                       getattr(self.batch_sampler, "sampler", None), self.dataset):
            if target is not None and id(target) not in seen and hasattr(target, "set_epoch"):
                seen.add(id(target))
                target.set_epoch(epoch)
        pending = self._tds_pending
        if pending is not None and pending["epoch"] != epoch:
            logger.warning("set_epoch(%d) discards the restored position in epoch %d",
                           epoch, pending["epoch"])
            self._tds_pending = None
        self._tds_next_epoch = epoch
        self._tds_seeded = True

    def __len__(self) -> int:
        if self._tds_iterable or not self._tds_seeded:
            return super().__len__()
        ranks = self._tds_ranks
        split = self._tds_split
        if self._tds_default_sampling:
            n = len(self.dataset)
            if split:
                m = (n - n % ranks.world_size) // ranks.world_size if self._tds_even \
                    else len(range(ranks.rank, n, ranks.world_size))
            else:
                m = n
            if self.batch_size is None:
                return m
            return m // self.batch_size if self.drop_last else math.ceil(m / self.batch_size)
        count = len(sampling.index_sampler(self))
        if not split:
            return count
        if self._tds_even:
            return count // ranks.world_size
        return len(range(ranks.rank, count, ranks.world_size))

    def _tds_begin_epoch(self) -> tuple[int, int, dict | None]:
        """(epoch, batches already yielded in it, RNG snapshot to draw it from)."""
        pending, self._tds_pending = self._tds_pending, None
        if pending is not None:
            epoch = pending["epoch"]
            skip = pending["batches_yielded"] if pending["in_progress"] else 0
            rng = pending["rng"]
        else:
            epoch, skip, rng = self._tds_next_epoch, 0, None
        self._tds_next_epoch = epoch + 1
        return epoch, skip, rng

    def _tds_draw(self, epoch: int, rng: dict | None) -> tuple[list[Any], dict | None]:
        """This rank's index batches of `epoch`, and the RNG snapshot they were drawn from."""
        ranks = self._tds_ranks
        if self._tds_seeded:
            seed = self._tds_base_seed
            assert seed is not None
            if self._tds_default_sampling:
                rank, world = (ranks.rank, ranks.world_size) if self._tds_split else (0, 1)
                order = sampling.seeded_default_order(
                    len(self.dataset), self._tds_shuffle, seed, epoch, rank, world,
                    self._tds_even)
                return sampling.batched(order, self.batch_size, self.drop_last), None
            batches = sampling.seeded_custom_order(self, seed, epoch)
            if self._tds_split:
                batches = sampling.split_batches(batches, ranks.rank, ranks.world_size,
                                                 self._tds_even)
            return batches, None
        if rng is None:
            rng = sampling.rng_snapshot(self)
            return sampling.torch_order(self), rng
        with sampling.replaying(self, rng):
            return sampling.torch_order(self), rng

    # ------------------------------------------------------------------------ iteration

    def __iter__(self) -> _LoaderIterator:
        epoch, skip, rng = self._tds_begin_epoch()
        stats = self._tds_stats
        stats.samples_dropped, stats.batches_dropped = even_batches_loss(self)
        self._tds_passes += 1  # in job names: an epoch read again is a new job
        if self._tds_iterable:
            return self._tds_iter_pipeline(epoch, skip)
        batches, rng = self._tds_draw(epoch, rng)
        progress = _Progress(epoch, skip, len(batches), rng)
        self._tds_progress = progress
        items = list(enumerate(batches))[skip:]
        ordered = (self.in_order and self._tds_policy == ShardingPolicy.DYNAMIC
                   and self._tds_job_name is None)
        if not items:
            return self._tds_iterator(lambda: iter(()), progress, None)
        service = self._tds_service_target()
        # Registered here, not on the reading thread, so that a dataset that cannot be pickled
        # fails in iter() as it would with torch's spawned workers.
        try:
            dataset_id = self._tds_register_epoch(service, items)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:
                raise
            # The dispatcher lost the shared object (restarted without a journal): again.
            self._tds_shared = None
            dataset_id = self._tds_register_epoch(service, items)
        job_name = self._tds_user_job(epoch)
        reader = from_dataset_id(self._tds_policy, service, dataset_id, job_name=job_name,
                                 max_outstanding_requests=self._tds_max_outstanding)
        return self._tds_iterator(lambda: iter(reader), progress, skip if ordered else None,
                              positioned=True)

    def _tds_register_epoch(self, service: Any, items: list[tuple[int, Any]]) -> str:
        fetch = SharedFetchBatch(self._tds_fetch_ref(service))
        pipeline = Pipeline.from_items(items).with_split_size(1).map(fetch)
        # Ephemeral: the dispatcher drops it once its iteration is collected, so a long run
        # does not keep every epoch's index batches. Loaders sharing a job_name register the
        # same batches: the fingerprint makes them one dataset.
        definition = dataset_def(pipeline, self._tds_compression)
        definition.ephemeral = True
        definition.fingerprint = "ephemeral:" + definition.fingerprint
        return register_definition(service, definition)

    def _tds_fetch_ref(self, service: Any) -> SharedObjectRef:
        """The dataset and collate_fn as a shared object: registered when first seen or when
        their pickle changed (see the module docstring)."""
        key = str(service)
        cached = self._tds_shared
        if cached is not None and cached[0] == key and self.persistent_workers:
            return SharedObjectRef(cached[2])
        definition = shared_object_def(
            FetchBatch(self.dataset, self._auto_collation, self.collate_fn))
        if cached is None or cached[:2] != (key, definition.fingerprint):
            dataset_id = register_definition(service, definition)
            cached = self._tds_shared = (key, definition.fingerprint, dataset_id)
        return SharedObjectRef(cached[2])

    def _tds_iter_pipeline(self, epoch: int, skip: int) -> _LoaderIterator:
        dataset = self.dataset
        pipeline = dataset if isinstance(dataset, Pipeline) else Pipeline.from_iterable(dataset)
        if self._auto_collation:
            pipeline = pipeline.batch(self.batch_size, self.drop_last, self.collate_fn)
        else:
            pipeline = pipeline.map(self.collate_fn)
        policy = self._tds_policy
        if policy == ShardingPolicy.DYNAMIC and not pipeline.is_splittable:
            # Not splittable: each worker produces the whole dataset, as each of torch's
            # worker processes would without get_worker_info() sharding.
            policy = ShardingPolicy.OFF
        service = self._tds_service_target()
        ranks = self._tds_ranks
        dataset_id = None
        consumer_index = num_consumers = None
        job_name = self._tds_user_job(epoch)
        if ranks.distributed:
            if self._tds_token is None:
                # Unique per run, so a later run on the same service never joins this one's jobs.
                self._tds_token = broadcast_token() if ranks.process_group \
                    else f"run{run_seed()}"
            # One dataset id and job for all ranks, named alike on every rank (the n-th such
            # loader of each rank, or the job_name given): the first rank's registration is
            # reused by the others.
            loader = self._tds_job_name or str(self._tds_loader_number)
            name = f"tds-dataloader-{self._tds_token}-{loader}-epoch{epoch}-{self._tds_passes}"
            dataset_id = job_name = name
            if self._tds_even:
                # Coordinated reads: round r is num_consumers consecutive batches of one worker,
                # rank i gets the i-th, and the job ends at a round boundary for every rank.
                consumer_index, num_consumers = ranks.rank, ranks.world_size
        dataset_id = register_dataset(service, pipeline, compression=self._tds_compression,
                                      dataset_id=dataset_id)
        reader = from_dataset_id(policy, service, dataset_id, job_name=job_name,
                                 consumer_index=consumer_index, num_consumers=num_consumers,
                                 max_outstanding_requests=self._tds_max_outstanding)
        progress = _Progress(epoch, skip, None, None)
        self._tds_progress = progress
        return self._tds_iterator(lambda: iter(reader), progress, None, skip_first=skip)

    def _tds_user_job(self, epoch: int) -> str | None:
        """The job of this pass for a user-given job_name (one per epoch and pass)."""
        if self._tds_job_name is None:
            return None
        return f"{self._tds_job_name}/epoch{epoch}/pass{self._tds_passes}"

    def _tds_service_target(self) -> Any:
        return embedded.embedded_target() if self._tds_embedded else self._tds_service

    def _tds_iterator(self, open_source: Callable[[], Iterator[Any]], progress: _Progress,
                      reorder_from: int | None, *, positioned: bool = False,
                      skip_first: int = 0) -> _LoaderIterator:
        pin_device = None
        if self.pin_memory:
            if torch.accelerator.is_available():
                accelerator = torch.accelerator.current_accelerator()
                pin_device = accelerator.type if accelerator is not None else None
                if pin_device == "mps":
                    pin_device = None
            else:
                warnings.warn("'pin_memory' argument is set as true but no accelerator is "
                              "found, then device pinned memory won't be used.", stacklevel=3)
        depth = max(2, self.prefetch_factor or 2)
        stats = self._tds_stats
        iterator = _LoaderIterator(lambda: feeding(stats, open_source()), progress,
                                   reorder_from, positioned, skip_first, pin_device,
                                   float(self.timeout), depth)
        iterator.stats = stats
        return iterator

    # ------------------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: the epoch, batches yielded in it, and what it was drawn from
        (torchdata StatefulDataLoader convention; `torch.save`-able)."""
        if self._tds_pending is not None:
            return dict(self._tds_pending)
        ranks = self._tds_ranks
        state: dict[str, Any] = {"base_seed": self._tds_base_seed, "seeded": self._tds_seeded,
                                 "rank": ranks.rank, "world_size": ranks.world_size}
        progress = self._tds_progress
        if progress is not None and not progress.finished:
            state.update(epoch=progress.epoch, batches_yielded=progress.yielded,
                         in_progress=True, rng=progress.rng)
        else:
            rng = None
            if not self._tds_seeded and not self._tds_iterable:
                rng = sampling.rng_snapshot(self)  # what the next epoch will draw from
            state.update(epoch=self._tds_next_epoch, batches_yielded=0, in_progress=False,
                         rng=rng)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from `state_dict`: the next `iter()` yields the batches not yet yielded
        in the saved epoch (or starts the saved next epoch)."""
        missing = [key for key in STATE_KEYS if key not in state_dict]
        if missing:
            raise ValueError(f"not a tds.DataLoader state: missing {missing}")
        ranks = self._tds_ranks
        saved = (state_dict["rank"], state_dict["world_size"])
        if saved != (ranks.rank, ranks.world_size) and self._tds_split:
            raise ValueError(
                f"state of rank {saved[0]} of {saved[1]} cannot resume rank {ranks.rank} of "
                f"{ranks.world_size}: each rank restores its own state, in a run of the same size")
        self._tds_base_seed = state_dict["base_seed"]
        self._tds_seeded = bool(state_dict["seeded"])
        self._tds_next_epoch = int(state_dict["epoch"])
        self._tds_pending = {key: state_dict[key] for key in STATE_KEYS}
        self._tds_progress = None


def _check_worker_arguments(num_workers: int, prefetch_factor: int | None,
                            persistent_workers: bool) -> None:
    """torch's checks of the arguments that only configure its worker processes."""
    if num_workers < 0:
        raise ValueError("num_workers option should be non-negative; "
                         "use num_workers=0 to disable multiprocessing.")
    if num_workers == 0 and prefetch_factor is not None:
        raise ValueError("prefetch_factor option could only be specified in multiprocessing."
                         "let num_workers > 0 to enable multiprocessing, otherwise set "
                         "prefetch_factor to None.")
    if prefetch_factor is not None and prefetch_factor < 0:
        raise ValueError("prefetch_factor option should be non-negative")
    if persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers option needs num_workers > 0")


@dataclass
class _Progress:
    """How far the latest iterator got: what `state_dict()` saves."""

    epoch: int
    yielded: int
    total: int | None
    rng: dict | None
    finished: bool = False


class _End:
    pass


@dataclass
class _Failure:
    error: BaseException


class _Stopped(Exception):
    pass


class _LoaderIterator:
    """One epoch. A reading thread pulls from the service, restores order, pins, and fills a
    small queue; `__next__` takes from it, so a wait longer than `timeout` can be detected."""

    def __init__(self, open_source: Callable[[], Iterator[Any]], progress: _Progress,
                 reorder_from: int | None, positioned: bool, skip_first: int,
                 pin_device: str | None, timeout: float, depth: int) -> None:
        self._progress = progress
        self._timeout = timeout
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self.stats = ClientStats()  # replaced by the loader's own (DataLoader.stats())
        # The thread holds no reference to this object, so an abandoned iterator is collected
        # and its __del__ stops the thread.
        self._thread = threading.Thread(
            target=_read_epoch,
            args=(open_source, self._queue, self._stop, reorder_from, progress.total,
                  positioned, skip_first, pin_device),
            name="tds-dataloader-reader", daemon=True)
        self._thread.start()

    def __iter__(self) -> _LoaderIterator:
        return self

    def __len__(self) -> int:
        if self._progress.total is None:
            raise TypeError("this DataLoader's iterator has no length")
        return self._progress.total

    def _get(self) -> Any:
        if self._timeout > 0:
            try:
                return self._queue.get(timeout=self._timeout)
            except queue.Empty:
                raise RuntimeError(
                    f"DataLoader timed out after {self._timeout} seconds") from None
        return self._queue.get()

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        blocked = time.perf_counter()
        try:
            item = self._get()
        except BaseException:
            self._finish(failed=True)
            raise
        self.stats.wait_seconds += time.perf_counter() - blocked  # DataLoader.stats()
        if isinstance(item, _End):
            self._finish(failed=False)
            raise StopIteration
        if isinstance(item, _Failure):
            self._finish(failed=True)
            raise item.error
        self._progress.yielded += 1
        self.stats.batches += 1
        return item

    def _finish(self, failed: bool) -> None:
        self._done = True
        if not failed:
            self._progress.finished = True
        self._stop.set()

    def close(self) -> None:
        """Stop reading (also done when the iterator is garbage-collected)."""
        self._done = True
        self._stop.set()

    def __del__(self) -> None:
        self._stop.set()


def _read_epoch(open_source: Callable[[], Iterator[Any]], out: queue.Queue, stop: threading.Event,
                reorder_from: int | None, end: int | None, positioned: bool, skip_first: int,
                pin_device: str | None) -> None:
    """The reading thread: service elements -> (reordered, pinned) batches -> `out`.

    In order, positions `reorder_from` .. `end` - 1 are expected: the epoch ends as soon as
    the last one is out, without waiting for the service to notice the iteration's end.
    """

    def put(item: Any) -> None:
        while not stop.is_set():
            try:
                out.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                continue
        raise _Stopped

    def emit(batch: Any) -> None:
        if pin_device is not None:
            from torch.utils.data._utils.pin_memory import pin_memory

            batch = pin_memory(batch, pin_device)
        put(batch)

    source: Iterator[Any] | None = None
    try:
        source = open_source()
        if reorder_from is not None:
            waiting: dict[int, Any] = {}
            next_position = reorder_from
            for position, batch in source:
                if stop.is_set():
                    raise _Stopped
                waiting[position] = batch
                while next_position in waiting:
                    emit(waiting.pop(next_position))
                    next_position += 1
                if end is not None and next_position >= end:
                    break
            # Only a failed worker leaves gaps (DYNAMIC: each split at most once then).
            for position in sorted(waiting):
                if end is None or position < end:
                    emit(waiting[position])
        else:
            skipped = 0
            for element in source:
                if stop.is_set():
                    raise _Stopped
                if skipped < skip_first:
                    skipped += 1
                    continue
                emit(element[1] if positioned else element)
        put(_End())
    except _Stopped:
        pass
    except BaseException as error:  # reaches the consumer on its next __next__
        try:
            put(_Failure(error))
        except _Stopped:
            pass
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()

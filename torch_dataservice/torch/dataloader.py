"""`tds.DataLoader`: torch's DataLoader, with the batches made by the service's workers.

Map-style datasets (the common case): every epoch the loader draws its index batches on the
trainer exactly as torch would (`epochs.py`, `sampling.py`), numbers them, and registers them
as one split each (`registration.py`): the dispatcher hands them out (DYNAMIC) to whichever
worker process asks next, which runs `collate_fn([dataset[i] for i in index_batch])` as torch's
worker `position % num_workers` would (`fetch.py`). A small reorder buffer keyed by position
restores torch's order (`in_order=True`); it stays small because splits are handed out in
order, so only batches overtaken by a slower one wait (`loader_iter.py`).

Under torchrun every rank draws the same global order from the same seed (no communication)
and registers its own part (`dealing.py`): item i goes to rank i % world_size, and with
`even_batches` (True or "drop") the order is first cut to a multiple of world_size ("pad":
its first items are given again), so every rank yields the same number of batches and DDP
cannot hang at the end of an epoch. With the default samplers this is exactly
`DistributedSampler(drop_last=True)` (or `drop_last=False`) + `BatchSampler`: at most
world_size - 1 samples are dropped per epoch. With a user's sampler or batch_sampler the
global batches are dealt out, so at most world_size - 1 batches are dropped. A
`DistributedSampler` passed by the user already splits by rank and is used as it is.

Iterable datasets run as torch runs them with `num_workers` workers (`shards.py`); Pipelines
run on the workers as they are (batched there with torch's collation rules). Under torchrun all
ranks read one shared job with coordinated reads (rank = consumer index): in each step all
ranks get consecutive batches of the same worker, and the job ends at the same step for every
rank.

`state_dict()` / `load_state_dict()` follow torchdata's StatefulDataLoader (`state.py`): a
loader restored from a state taken after k batches of an epoch re-draws that epoch and
registers only the batches not yet yielded. Under torch.distributed a map-style loader's state
is one for all ranks (`global_state.py`, a collective): the epoch's global positions some rank
had yielded, so that a loader at any world size deals out the rest (`dealing.py`).
"""

from __future__ import annotations

import logging
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.data
from torch.utils.data import IterableDataset

from torch_dataservice.client.api import ReadOptions, ShardingPolicy
from torch_dataservice.observability.client import ClientStats
from torch_dataservice.pipeline import Pipeline
from torch_dataservice.torch import embedded, global_state, iterable_state, sampling, state
from torch_dataservice.torch.dealing import UNEVEN, Deal, batch_count, even_policy
from torch_dataservice.torch.distributed import RankInfo, rank_info, run_seed
from torch_dataservice.torch.epochs import Epoch, EpochPlanner, seeded_worker_seed
from torch_dataservice.torch.fetch import EpochSeeds, FetchBatch
from torch_dataservice.torch.loader_iter import (
    IterOptions,
    LoaderIterator,
    Progress,
    Reading,
    read_arrivals,
    read_positions,
    read_shards,
    reading_from,
    reading_positions,
)
from torch_dataservice.torch.loader_stats import record_even_batches
from torch_dataservice.torch.registration import Registrar
from torch_dataservice.torch.shards import RunShard

logger = logging.getLogger(__name__)

STATE_KEYS = state.REQUIRED_KEYS


class DataLoader(torch.utils.data.DataLoader):
    """A drop-in for `torch.utils.data.DataLoader` fed by the service.

    Takes torch's arguments (same positions) and yields the same batches. `num_workers` is how
    many torch workers the batches are made as (WorkerInfo, seeds, `worker_init_fn`, an
    iterable dataset's shards), not a number of processes: the service's workers do the work;
    `prefetch_factor` and `persistent_workers` shape the draws and seeds as in torch, and
    `multiprocessing_context` is checked and ignored. Keyword-only extras:

    - `service`: `"grpc://HOST:PORT"`; None reads `TORCH_DATASERVICE_ADDRESS`, and if that is
      unset starts a dispatcher and a worker in this process (`embedded.py`).
    - `processing_mode`: how the service divides the work. The default, DYNAMIC
      ("distributed_epoch"), makes each batch once; the others keep tf.data service's meaning
      ("parallel_epochs": every worker makes the whole epoch) and yield in arrival order.
    - `job_name`: loaders with the same name share each epoch's batches, first come first
      served (then batches come in arrival order). Under torchrun an iterable dataset's ranks
      share one job anyway; a `job_name` given there names it (all ranks must pass the same).
    - `even_batches`: under torchrun, `True` (= "drop") cuts each epoch to a multiple of the
      world size, "pad" repeats its first samples as `DistributedSampler(drop_last=False)`,
      so every rank yields the same number of batches; `False` deals it out unevenly. (An
      iterable dataset's ranks read one coordinated job, which ends at a round boundary
      with either True or "pad".)
    - `compression`, `max_outstanding_requests`, `target_workers`: as in `tds.distribute`
      (`target_workers="LOCAL"` reads only workers on this host, over their Unix socket;
      `"ANY"` reads every worker over TCP, as a remote trainer does).

    The dataset, `collate_fn` and `worker_init_fn` travel to the workers with cloudpickle (by
    value when they are defined in the training script), once, or again in an epoch where their
    pickle changed; each executor process makes a fresh copy per epoch (with
    `persistent_workers`, one for the loader's life), as torch's workers get theirs.
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
        even_batches: bool | str = True,
        compression: str | None = "AUTO",
        max_outstanding_requests: int | None = None,
        target_workers: str = "AUTO",
    ) -> None:
        """torch's DataLoader arguments, then the service's (long: torch's signature)."""
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
                                    None, max_outstanding_requests, None, target_workers)
        if compression not in ("AUTO", None):
            raise ValueError(f"compression must be 'AUTO' or None, got {compression!r}")
        self._tds_policy = options.policy
        self._tds_even = even_policy(even_batches)
        self._tds_iterable = isinstance(self.dataset, IterableDataset)
        self._tds_default_sampling = sampler is None and batch_sampler is None
        self._tds_shuffle = bool(shuffle)
        self._tds_ranks: RankInfo = rank_info()
        self._tds_split = (self._tds_ranks.distributed and not self._tds_iterable
                           and not sampling.splits_by_rank(self))
        service, embedded_service = embedded.resolve(service)
        if self._tds_iterable and self._tds_ranks.distributed and embedded_service:
            raise ValueError(
                "under torch.distributed an iterable dataset or Pipeline is read as one job "
                "shared by all ranks, which needs one service for all of them: pass "
                "service='grpc://HOST:PORT' or set TORCH_DATASERVICE_ADDRESS")
        if embedded_service:
            embedded.prepare()
        self._tds_registrar = Registrar(
            service, embedded_service, options.policy, job_name, compression,
            max_outstanding_requests, self._tds_ranks, self._tds_even != UNEVEN,
            Registrar.new_iterable_number() if self._tds_iterable else -1,
            target_workers=options.target_workers)

        # Epochs. Seeded: an epoch's draw is a function of (seed, epoch), as with
        # DistributedSampler; otherwise the loader draws exactly as torch's, from the
        # generators' current state.
        if generator is not None:
            seed: int | None = generator.initial_seed()
        elif self._tds_ranks.distributed:
            seed = run_seed()
        else:
            seed = None  # drawn from torch's global RNG by the first set_epoch
        self._tds_epochs = EpochPlanner(seed, self._tds_split, persistent_workers)
        self._tds_progress: Progress | None = None
        self._tds_epoch: Epoch | None = None  # the latest iter()'s
        self._tds_stats = ClientStats(rank=self._tds_ranks.rank)  # see stats()
        self._tds_check_workers()  # torch's warning, as its __init__ gives it

    def _tds_check_workers(self) -> None:
        """torch's warning that `num_workers` exceeds this machine's cores, where the service's
        executors share them (the embedded service); a remote service's do not."""
        if self._tds_registrar.embedded:
            self.check_worker_number_rationality()

    def stats(self) -> dict[str, Any]:
        """What this loader took and waited for, over its life: batches, elements and bytes
        received, seconds `__next__` blocked, per worker; and per epoch the samples (or, with
        a custom sampler, batches) `even_batches` dropped or padded."""
        return self._tds_stats.as_dict()

    # ------------------------------------------------------------------------ epochs

    def set_epoch(self, epoch: int) -> None:
        """Make the next `iter()` epoch `epoch`, shuffled as `DistributedSampler.set_epoch`
        would (seed = the generator's initial seed, or one shared by the run's ranks)."""
        self._tds_epochs.set_epoch(epoch, self)

    def __len__(self) -> int:
        """This rank's batches in the epoch: a resumed epoch's remainder, else a whole one."""
        if self._tds_iterable or not self._tds_epochs.seeded:
            return super().__len__()
        rank, world = (self._tds_ranks.rank, self._tds_ranks.world_size) if self._tds_split \
            else (0, 1)
        pending, epoch = self._tds_epochs.pending, self._tds_epoch
        progress = self._tds_progress
        if pending is not None and global_state.is_global(pending) and pending["in_progress"]:
            deal = Deal(pending["length"], world, self._tds_even,
                        tuple(pending["consumed_ranges"]))
        elif (pending is None and epoch is not None and epoch.deal is not None
              and progress is not None and not progress.finished):
            deal = epoch.deal
        else:
            deal = Deal(self._tds_epoch_length(), world, self._tds_even)
        if not self._tds_default_sampling:
            return deal.count(rank)
        return batch_count(deal.count(rank), self.batch_size, self.drop_last)

    def _tds_epoch_length(self) -> int:
        """Positions in an epoch's global order: samples, or a user sampler's batches."""
        if self._tds_default_sampling:
            return len(self.dataset)
        return len(sampling.index_sampler(self))

    # ------------------------------------------------------------------------ iteration

    def __iter__(self) -> LoaderIterator:
        self._tds_check_workers()  # torch warns at every iter() too
        epoch = self._tds_epochs.begin(self, self._tds_iterable)
        self._tds_epoch = epoch
        stats = self._tds_stats
        record_even_batches(stats, None, True)  # until the epoch is dealt out
        self._tds_registrar.passes += 1  # in job names: an epoch read again is a new job
        # Map-style: the positions yielded (an out-of-order resume leaves them out).
        positions = set() if self._tds_iterable else set(epoch.positions or range(epoch.yielded))
        progress = Progress(epoch.number, epoch.yielded, None, epoch.rng, positions)
        self._tds_progress = progress
        options = self._tds_iter_options()
        options.stats = stats
        if self._tds_iterable:
            reading = self._tds_read_iterable(epoch)
            return LoaderIterator(lambda: reading, progress, options)
        fetch = FetchBatch(self.dataset, self._auto_collation, self.collate_fn,
                           self.worker_init_fn)
        # Registered here, so that a dataset that cannot be pickled fails in iter() as it
        # would with torch's spawned workers.
        ref = self._tds_registrar.fetch_ref(fetch, self.persistent_workers)
        # num_workers=0: torch's sampler draws at the first next(); with workers, at iter().
        lazy = self.num_workers == 0 and epoch.batches is None and not self._tds_epochs.seeded
        if self.num_workers == 0:
            options.on_next = epoch.advance
        else:
            options.on_yield = epoch.advance
        return LoaderIterator(lambda: self._tds_read_map(epoch, progress, fetch, ref),
                              progress, options, lazy=lazy)

    def _tds_seeds(self, epoch: Epoch) -> EpochSeeds:
        ranks = self._tds_ranks
        stride, offset = (ranks.world_size, ranks.rank) if self._tds_split else (1, 0)
        base_seed = epoch.worker_seed
        job_name = self._tds_registrar.job_name
        if job_name is not None:
            # Loaders sharing a job register the same epoch, so its seeds cannot be drawn by
            # each: they are a function of the job's name and epoch.
            base_seed = seeded_worker_seed(zlib.crc32(job_name.encode()), epoch.number)
        return EpochSeeds(base_seed, epoch.round, self.num_workers, stride, offset,
                          epoch.first_batch)

    def _tds_read_map(self, epoch: Epoch, progress: Progress, fetch: FetchBatch,
                      ref: Any) -> Reading:
        """Draw the epoch's batches, register those not yet yielded, and read them."""
        ranks = self._tds_ranks
        batches = self._tds_epochs.draw(
            self, epoch, ranks.rank, ranks.world_size, self._tds_split, self._tds_even,
            self._tds_default_sampling, self._tds_shuffle)
        record_even_batches(self._tds_stats, epoch.deal, self._tds_default_sampling)
        progress.total = len(batches)
        if self.num_workers > 0:
            epoch.advance(self.num_workers * (self.prefetch_factor or 2))  # torch's prefetch
        items = [(p, b) for p, b in enumerate(batches) if p not in progress.positions]
        if not items:
            return lambda emit, sources: None
        registrar, seeds = self._tds_registrar, self._tds_seeds(epoch)
        reader = registrar.read_epoch(epoch.number, items, seeds, ref, fetch)
        # Released after a stall (job_gc_timeout_ms), the rest is registered again; not under
        # a job_name, whose job other loaders share.
        register = None if registrar.job_name is not None else (
            lambda left: registrar.read_epoch(epoch.number, left, seeds, ref, fetch))
        if (self.in_order and registrar.policy == ShardingPolicy.DYNAMIC
                and registrar.job_name is None):
            return reading_positions(reader, items, register, read_positions)
        return reading_positions(reader, items, register, lambda source, emit, _: read_arrivals(
            source, emit, 0, True, False))

    def _tds_read_iterable(self, epoch: Epoch) -> Reading:
        """Register an iterable epoch (num_workers shards, or a Pipeline as it is) and read it,
        without the first `epoch.yielded` batches of a restored epoch."""
        dataset = self.dataset
        registrar = self._tds_registrar
        skip = epoch.yielded
        if isinstance(dataset, Pipeline):
            if self._auto_collation:
                if iterable_state.applies(self):  # batches within splits: an exact state
                    dataset = iterable_state.aligned(dataset, self.batch_size)
                pipeline = dataset.batch(self.batch_size, self.drop_last, self.collate_fn)
            else:
                pipeline = dataset.map(self.collate_fn)
            if iterable_state.reads(self, epoch.number):  # DYNAMIC: by splits
                return iterable_state.reading(self, pipeline, epoch.number, shards=False)
            reader = registrar.read_iterable(pipeline, epoch.number)
            return reading_from(lambda: iter(reader), lambda source, emit: read_arrivals(
                source, emit, skip, False, False))
        num_shards = max(1, self.num_workers)
        # Merged in torch's order when this loader reads each shard once, alone.
        merged = (self.in_order and registrar.policy == ShardingPolicy.DYNAMIC
                  and registrar.job_name is None and not self._tds_ranks.distributed)
        run = RunShard(dataset, self._tds_seeds(epoch), self._auto_collation, self.collate_fn,
                       self.drop_last, self.batch_size, end_markers=merged,
                       worker_init_fn=self.worker_init_fn)
        pipeline = Pipeline.from_items(list(range(num_shards))).with_split_size(1).flat_map(run)
        if iterable_state.reads(self, epoch.number):  # DYNAMIC: by splits
            return iterable_state.reading(self, pipeline, epoch.number, shards=True)
        reader = registrar.read_iterable(pipeline, epoch.number)
        if merged:
            return reading_from(lambda: iter(reader), lambda source, emit: read_shards(
                source, emit, num_shards, skip))
        return reading_from(lambda: iter(reader), lambda source, emit: read_arrivals(
            source, emit, skip, False, True))

    def _tds_iter_options(self) -> IterOptions:
        """What the iterator needs of the loader, with torch's warnings about pinning."""
        pin_device = None
        if self.pin_memory and self.pin_memory_device:
            torch_warn("pin_memory_device is deprecated, the current accelerator will be used "
                       f"as the device,ignore pin_memory_device='{self.pin_memory_device}'.")
        if self.pin_memory:
            if torch.accelerator.is_available():
                accelerator = torch.accelerator.current_accelerator()
                pin_device = accelerator.type if accelerator is not None else None
                if pin_device == "mps":
                    pin_device = None
            else:
                torch_warn("'pin_memory' argument is set as true but no accelerator is found, "
                           "then device pinned memory won't be used.")
        return IterOptions(
            timeout=self.timeout, depth=max(2, self.prefetch_factor or 2), pin_device=pin_device,
            iterable_len=self._IterableDataset_len_called if self._tds_iterable else None,
            dataset=self.dataset, num_workers=self.num_workers, length=self.__len__)

    # ------------------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: the epoch, batches yielded in it, and what it was drawn from
        (torchdata StatefulDataLoader convention; plain data: `json.dumps`-able).

        Under torch.distributed a map-style loader's state is one for all ranks (a collective:
        call it on every rank at the same step), resumable at any world size (global_state.py);
        a DYNAMIC Pipeline or IterableDataset saves the splits consumed (iterable_state.py)."""
        if iterable_state.saves(self):
            return iterable_state.state_dict(self)
        planner = self._tds_epochs
        if self._tds_saves_global():
            saved = self._tds_global_state()
            if saved is not None:
                return saved
        if planner.pending is not None:
            if global_state.is_global(planner.pending):
                return global_state.reencoded(planner.pending)
            saved = dict(planner.pending)
            saved["rng"] = state.encode_rng(saved["rng"])
            return saved
        ranks = self._tds_ranks
        saved = {"base_seed": planner.seed, "seeded": planner.seeded, "rank": ranks.rank,
                 "world_size": ranks.world_size, "worker_seed": planner.worker_seed,
                 "worker_round": planner.round, "positions": None}
        progress = self._tds_progress
        if progress is not None and not progress.finished:
            saved.update(epoch=progress.epoch, batches_yielded=progress.yielded,
                         in_progress=True, rng=state.encode_rng(progress.rng),
                         positions=state.positions_of(progress.positions, progress.yielded))
        else:
            # What the next epoch will draw from.
            rng = None if planner.seeded else sampling.rng_snapshot(self)
            saved.update(epoch=planner.next_epoch, batches_yielded=0, in_progress=False,
                         rng=state.encode_rng(rng))
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue from `state_dict` at the next `iter()` (an iterator already running goes
        on as it is): the batches not yet yielded in the saved epoch, or the saved next epoch.
        An empty dict changes nothing, as with torchdata's StatefulDataLoader. A global state
        (saved under torch.distributed) loads at any world size."""
        if isinstance(state_dict, dict) and not state_dict:
            return
        state_dict = iterable_state.loading(self, state_dict)  # a split state: its epoch
        planner = self._tds_epochs
        if global_state.is_global(state_dict) and not self._tds_iterable:
            if sampling.splits_by_rank(self):
                raise ValueError("a global state cannot resume a loader whose sampler is a "
                                 "DistributedSampler: that sampler splits the epoch itself")
            try:
                length: int | None = self._tds_epoch_length()
            except TypeError:  # a sampler without a length: checked when drawn
                length = None
            loaded = global_state.validated(state_dict, self._tds_unit(), length)
            planner.seed, planner.seeded = loaded["base_seed"], True
        else:
            loaded = self._tds_validated_rank_state(state_dict)
            planner.seed = loaded["base_seed"]
            planner.seeded = bool(loaded["seeded"])
        planner.next_epoch = loaded["epoch"]
        planner.pending = loaded
        self._tds_progress = None

    def _tds_validated_rank_state(self, state_dict: Any) -> dict[str, Any]:
        """A per-rank state, checked to be this rank's when ranks split epochs."""
        loaded = state.validated(state_dict)
        ranks = self._tds_ranks
        saved = (loaded["rank"], loaded["world_size"])
        if saved != (ranks.rank, ranks.world_size) and self._tds_split:
            raise ValueError(
                f"state of rank {saved[0]} of {saved[1]} cannot resume rank {ranks.rank} of "
                f"{ranks.world_size}: each rank restores its own state, in a run of the same size")
        return loaded

    def _tds_unit(self) -> str:
        return global_state.SAMPLES if self._tds_default_sampling else global_state.BATCHES

    def _tds_saves_global(self) -> bool:
        """Whether state_dict() is the global one: seeded map-style epochs dealt by this loader,
        under a process group, or in an epoch resumed from a global state."""
        planner = self._tds_epochs
        if self._tds_iterable or not planner.seeded or sampling.splits_by_rank(self):
            return False
        progress, epoch = self._tds_progress, self._tds_epoch
        if (planner.pending is None and progress is not None and not progress.finished
                and (epoch is None or epoch.deal is None)):
            return False  # an epoch drawn as torch draws it (set_epoch came after its iter())
        if self._tds_ranks.process_group:
            return True
        if planner.pending is not None:
            return global_state.is_global(planner.pending)
        return epoch is not None and epoch.consumed is not None

    def _tds_global_state(self) -> dict[str, Any] | None:
        """The state of all ranks together (a collective); None when every rank holds a loaded
        state not yet iterated (then that state is the answer)."""
        planner, epoch, ranks = self._tds_epochs, self._tds_epoch, self._tds_ranks
        rank = ranks.rank if self._tds_split else 0
        deal = epoch.deal if epoch is not None else None
        view = global_state.rank_view(planner.pending, self._tds_progress, deal,
                                      epoch.per_batch if epoch is not None else 1,
                                      planner.next_epoch, rank)
        views = global_state.gather(view, ranks)
        if all(v.phase == "pending" for v in views):
            return None
        number, in_progress, consumed, batches = global_state.combine(views, deal)
        length: int | None
        if in_progress:
            assert deal is not None
            length = deal.length
        else:
            try:
                length = self._tds_epoch_length()
            except TypeError:
                length = None
        return global_state.encode(number, in_progress, planner.seed, ranks.world_size, batches,
                                   self._tds_unit(), length, consumed)


def torch_warn(message: str) -> None:
    """A warning attributed to the caller of `iter()`, as torch's iterator gives it."""
    warnings.warn(message, stacklevel=4)


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

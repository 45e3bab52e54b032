"""Registering a `tds.DataLoader`'s epochs with the service, and naming their jobs.

Map-style: the dataset, collate_fn and worker_init_fn (a `FetchBatch`, pickled in a
`DatasetCopies`) are registered apart, as a shared object (pipeline/shared_objects.py), when
first seen or when their pickle changed (as torch's non-persistent workers would see a changed
dataset); with `persistent_workers=True` it is pickled once, as torch's persistent workers keep
their first copy, and registered under the loader's own name (its job_name, or a random one),
so that no other loader shares its workers' copies. Each epoch registers
`from_items([(position, index_batch), ...]).with_split_size(1).map(SharedFetchBatch(ref))` as
an ephemeral dataset, forgotten once its iteration is garbage-collected.

Iterable datasets become `num_workers` shards (shards.py); Pipelines run as they are. Under
torchrun all ranks read one shared job, named alike on every rank.

Named jobs carry torchrun's restart count (`job_identity`): a group restarted by
`--max-restarts` re-creates its loaders, and they must not join the jobs of the group they
replace, which the service may still hold.
"""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, field
from typing import Any

import grpc

from torch_dataservice.client.api import (
    ShardingPolicy,
    dataset_def,
    from_dataset_id,
    register_dataset,
    register_definition,
    shared_object_def,
)
from torch_dataservice.pipeline import Pipeline
from torch_dataservice.pipeline.shared_objects import SharedObjectRef
from torch_dataservice.torch import embedded
from torch_dataservice.torch.distributed import (
    RankInfo,
    broadcast_token,
    restart_count,
    run_seed,
)
from torch_dataservice.torch.fetch import (
    DatasetCopies,
    EpochSeeds,
    FetchBatch,
    SharedFetchBatch,
)

_iterable_loaders = itertools.count()  # names the shared jobs of iterable loaders under DDP


def job_identity(name: str) -> str:
    """`name`, distinct per torchrun restart of the group (unchanged outside torchrun and in
    its first attempt)."""
    restarts = restart_count()
    return f"{name}-restart{restarts}" if restarts else name


@dataclass
class Registrar:
    """Where a loader's epochs go and under which names."""

    service: Any
    embedded: bool
    policy: ShardingPolicy
    job_name: str | None
    compression: str | None
    max_outstanding: int | None
    ranks: RankInfo
    even: bool
    loader_number: int = -1
    target_workers: str = "AUTO"  # as tds.distribute's: which workers this loader reads
    token: str | None = None
    passes: int = 0
    # (service, fingerprint, dataset id, owner) of the DatasetCopies registered as a shared
    # object (owner: see DatasetCopies).
    shared: tuple[str, str, str, str | None] | None = None
    name: str = field(default_factory=lambda: uuid.uuid4().hex)  # a persistent loader's owner

    @classmethod
    def new_iterable_number(cls) -> int:
        return next(_iterable_loaders)

    def target(self) -> Any:
        return embedded.embedded_target() if self.embedded else self.service

    def user_job(self, epoch: int) -> str | None:
        """The job of this pass for a user-given job_name (one per epoch and pass)."""
        if self.job_name is None:
            return None
        return f"{job_identity(self.job_name)}/epoch{epoch}/pass{self.passes}"

    # ------------------------------------------------------------------ map-style
    def fetch_ref(self, fetch: FetchBatch, persistent: bool) -> SharedObjectRef:
        """The dataset, collate_fn and worker_init_fn as a shared object (see the module
        docstring). Pickled before any contact with the service."""
        key = str(self.target())
        cached = self.shared
        if cached is not None and cached[0] == key and persistent:
            return SharedObjectRef(cached[2])
        # Loaders sharing a job (job_name) share its batches, so also their workers' copies.
        owner = None
        if persistent:
            owner = job_identity(self.job_name) if self.job_name is not None else self.name
        definition = shared_object_def(DatasetCopies(fetch, owner))
        if cached is None or cached[:2] != (key, definition.fingerprint):
            dataset_id = register_definition(self.target(), definition)
            cached = self.shared = (key, definition.fingerprint, dataset_id, owner)
        return SharedObjectRef(cached[2])

    def read_epoch(self, epoch: int, items: list[tuple[int, Any]], seeds: EpochSeeds,
                   ref: SharedObjectRef, fetch: FetchBatch) -> Any:
        """Register one epoch's index batches (fetched through `ref`) and return its reader."""
        service = self.target()
        try:
            dataset_id = self._register_epoch(service, items, seeds, ref)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:
                raise
            # The dispatcher lost the shared object (restarted without a journal): again.
            persistent = self.shared is not None and self.shared[3] is not None
            self.shared = None
            ref = self.fetch_ref(fetch, persistent)
            dataset_id = self._register_epoch(service, items, seeds, ref)
        return from_dataset_id(self.policy, service, dataset_id, job_name=self.user_job(epoch),
                               max_outstanding_requests=self.max_outstanding,
                               target_workers=self.target_workers)

    def _register_epoch(self, service: Any, items: list[tuple[int, Any]], seeds: EpochSeeds,
                        ref: SharedObjectRef) -> str:
        shared = SharedFetchBatch(ref, seeds)
        pipeline = Pipeline.from_items(items).with_split_size(1).map(shared)
        # Ephemeral: the dispatcher drops it once its iteration is collected, so a long run
        # does not keep every epoch's index batches. Loaders sharing a job_name register the
        # same batches: the fingerprint makes them one dataset.
        definition = dataset_def(pipeline, self.compression)
        definition.ephemeral = True
        definition.fingerprint = "ephemeral:" + definition.fingerprint
        return register_definition(service, definition)

    # ------------------------------------------------------------------ iterable
    def read_iterable(self, pipeline: Pipeline, epoch: int) -> Any:
        """Register an iterable epoch's pipeline and return its reader (under torchrun: one
        job shared by every rank, coordinated when `even`)."""
        job = self.iterable_job(pipeline, epoch)
        return from_dataset_id(job.policy, job.service, job.dataset_id, job_name=job.job_name,
                               consumer_index=job.consumer_index,
                               num_consumers=job.num_consumers,
                               max_outstanding_requests=self.max_outstanding,
                               target_workers=self.target_workers)

    def iterable_job(self, pipeline: Pipeline, epoch: int) -> IterableJob:
        """Register an iterable epoch's pipeline and name the job that reads it."""
        policy = self.policy
        if policy == ShardingPolicy.DYNAMIC and not pipeline.is_splittable:
            # Not splittable: each worker produces the whole dataset.
            policy = ShardingPolicy.OFF
        service = self.target()
        ranks = self.ranks
        dataset_id = None
        consumer_index = num_consumers = None
        job_name = self.user_job(epoch)
        if ranks.distributed:
            if self.token is None:
                # Unique per run, so a later run on the same service never joins this one's jobs.
                self.token = job_identity(
                    broadcast_token() if ranks.process_group else f"run{run_seed()}")
            # One dataset id and job for all ranks, named alike on every rank (the n-th such
            # loader of each rank, or the job_name given): the first rank's registration is
            # reused by the others.
            loader = self.job_name or str(self.loader_number)
            name = f"tds-dataloader-{self.token}-{loader}-epoch{epoch}-{self.passes}"
            dataset_id = job_name = name
            if self.even:
                # Coordinated reads: round r is num_consumers consecutive batches of one worker,
                # rank i gets the i-th, and the job ends at a round boundary for every rank.
                consumer_index, num_consumers = ranks.rank, ranks.world_size
        dataset_id = register_dataset(service, pipeline, compression=self.compression,
                                      dataset_id=dataset_id)
        return IterableJob(policy, service, dataset_id, job_name, consumer_index, num_consumers,
                           self.target_workers)


@dataclass(frozen=True)
class IterableJob:
    """Where an iterable epoch is read: its registered dataset and its job."""

    policy: ShardingPolicy
    service: Any
    dataset_id: str
    job_name: str | None
    consumer_index: int | None
    num_consumers: int | None
    target_workers: str = "AUTO"

"""Static sharding: the `shard` transform, the SHARD_HINT placeholder, the pure rewrites the
worker applies under FILE / DATA / HINT sharding, and the plan that says which copies of a
pipeline a worker runs for a task, each rewritten how (`plan_replicas` -> `ShardingPlan`).

All shard arithmetic is one helper, `shard_slice`: shard `index` of `num_shards` holds the items
at positions index, index + num_shards, ... (files[index::num_shards], or element k when
k % num_shards == index).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from torch_dataservice.pipeline._checks import check_int
from torch_dataservice.pipeline.context import ExecutionContext
from torch_dataservice.pipeline.sources import FilesSource
from torch_dataservice.pipeline.transforms import Transform, Upstream, close_iterator
from torch_dataservice.policies import ShardingPolicy

if TYPE_CHECKING:
    from torch_dataservice.pipeline.core import Pipeline

logger = logging.getLogger(__name__)


class _ShardHint:
    """Placeholder for `shard()` arguments, replaced by (num_workers, worker_index) under HINT."""

    _instance: _ShardHint | None = None

    def __new__(cls) -> _ShardHint:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "SHARD_HINT"

    def __reduce__(self) -> str:
        # Pickled by reference, so `is SHARD_HINT` still holds after a round trip.
        return "SHARD_HINT"


SHARD_HINT: Any = _ShardHint()


def shard_slice(num_shards: int, index: int) -> slice:
    """Positions held by shard `index` of `num_shards`, after validating both."""
    num_shards, index = check_shard_args(num_shards, index)
    return slice(index, None, num_shards)


def check_shard_args(num_shards: Any, index: Any, *, allow_hint: bool = False) -> tuple[Any, Any]:
    """Validate shard arguments (optionally allowing SHARD_HINT); errors name the value."""
    if not (allow_hint and num_shards is SHARD_HINT):
        num_shards = check_int("num_shards", num_shards, minimum=1)
    if not (allow_hint and index is SHARD_HINT):
        index = check_int("shard index", index, minimum=0)
        if num_shards is not SHARD_HINT and index >= num_shards:
            raise ValueError(f"shard index must be < num_shards={num_shards}, got {index!r}")
    return num_shards, index


@dataclass(frozen=True, eq=False, repr=False)
class Shard(Transform):
    """Keeps element k where k % num_shards == index (tf `shard`)."""

    num_shards: Any
    index: Any

    def __post_init__(self) -> None:
        num_shards, index = check_shard_args(self.num_shards, self.index, allow_hint=True)
        object.__setattr__(self, "num_shards", num_shards)
        object.__setattr__(self, "index", index)

    @property
    def has_hint(self) -> bool:
        return self.num_shards is SHARD_HINT or self.index is SHARD_HINT

    def resolve(self, num_shards: int, index: int) -> Shard:
        """This shard with every SHARD_HINT replaced."""
        return dataclasses.replace(
            self,
            num_shards=num_shards if self.num_shards is SHARD_HINT else self.num_shards,
            index=index if self.index is SHARD_HINT else self.index,
        )

    def iterate(self, upstream: Upstream, ctx: ExecutionContext) -> Iterator[Any]:
        if self.has_hint:
            raise ValueError(
                f"{self.describe()} has an unresolved SHARD_HINT: it is only replaced when the "
                "pipeline runs on the service with sharding policy HINT"
            )
        positions = shard_slice(self.num_shards, self.index)
        iterator = upstream.open()
        try:
            yield from itertools.islice(iterator, positions.start, None, positions.step)
        finally:
            close_iterator(iterator)

    def describe(self) -> str:
        return f"shard({self.num_shards!r}, {self.index!r})"


def shard_files(pipeline: Pipeline, num_shards: int, index: int) -> Pipeline:
    """FILE sharding: the list_files (or tar shards) source keeps files[index::num_shards]."""
    source = pipeline.source
    if not isinstance(source, FilesSource):
        raise ValueError(
            "FILE sharding needs a list_files or from_tar_shards source, got "
            f"{source.describe()}; use DATA or FILE_OR_DATA sharding"
        )
    positions = shard_slice(num_shards, index)
    if len(source.files) < num_shards:
        raise ValueError(
            f"FILE sharding over {num_shards} workers needs at least as many files, but the "
            f"pipeline has fewer files: {len(source.files)} < {num_shards}"
        )
    sharded = dataclasses.replace(source, files=source.files[positions])
    return type(pipeline)(sharded, pipeline.transforms)


def shard_data(pipeline: Pipeline, num_shards: int, index: int) -> Pipeline:
    """DATA sharding: keep element k of the pipeline's output where k % num_shards == index."""
    return pipeline.shard(num_shards, index)


def resolve_shard_hints(pipeline: Pipeline, num_shards: int, index: int) -> tuple[Pipeline, bool]:
    """HINT sharding: replace SHARD_HINT in every shard() of the chain by (num_shards, index).

    Returns the rewritten pipeline and whether any placeholder was found; a pipeline without one
    is returned as it is. Placeholders inside flat_map/interleave functions are not visible here.
    """
    check_shard_args(num_shards, index)
    found = False
    transforms = []
    for transform in pipeline.transforms:
        if isinstance(transform, Shard) and transform.has_hint:
            transform = transform.resolve(num_shards, index)
            found = True
        transforms.append(transform)
    if not found:
        return pipeline, False
    return type(pipeline)(pipeline.source, transforms), True


# ---------------------------------------------------------------------- the worker's plan
class RewriteKind(enum.Enum):
    FILES = "files"  # shard_files
    DATA = "data"  # shard_data
    HINTS = "hints"  # resolve_shard_hints


@dataclass(frozen=True)
class Rewrite:
    """One static-sharding rewrite: keep shard `index` of `num_shards` (files, data or hints)."""

    kind: RewriteKind
    num_shards: int
    index: int

    def apply(self, pipeline: Pipeline) -> Pipeline:
        if self.kind is RewriteKind.FILES:
            return shard_files(pipeline, self.num_shards, self.index)
        if self.kind is RewriteKind.DATA:
            return shard_data(pipeline, self.num_shards, self.index)
        pipeline, found = resolve_shard_hints(pipeline, self.num_shards, self.index)
        if not found:
            logger.warning(
                "sharding policy HINT: the pipeline has no shard(SHARD_HINT, SHARD_HINT); "
                "every worker produces all of it"
            )
        return pipeline


@dataclass(frozen=True)
class ReplicaPlan:
    """One copy of a task's pipeline: its rewrites, and whether it reads splits it is given."""

    rewrites: tuple[Rewrite, ...] = ()
    use_splits: bool = False

    def apply(self, pipeline: Pipeline) -> Pipeline:
        """The rewritten pipeline; applied where it runs (an executor), never in the front."""
        for rewrite in self.rewrites:
            pipeline = rewrite.apply(pipeline)
        return pipeline


@dataclass(frozen=True)
class ShardingPlan:
    """The replicas a worker runs for a task. With `local_splits` the worker hands out the
    splits of the whole dataset to its replicas itself (OFF); otherwise replicas that use
    splits ask the dispatcher (DYNAMIC)."""

    replicas: tuple[ReplicaPlan, ...]
    local_splits: bool = False

    @property
    def use_splits(self) -> bool:
        return any(replica.use_splits for replica in self.replicas)


class TaskFacts(Protocol):
    """What the plan reads of a task (common_pb2.TaskDef has it)."""

    sharding_policy: int
    num_workers: int
    worker_index: int


class DatasetFacts(Protocol):
    """What the plan reads of a dataset (common_pb2.DatasetDef has it)."""

    file_based: bool
    splittable: bool
    order_sensitive: bool
    num_files: int


def plan_replicas(task: TaskFacts, dataset: DatasetFacts, num_executors: int) -> ShardingPlan:
    """How many copies of the pipeline run for `task`, each rewritten how.

    Replicas run in parallel on different cores; only transformations that do not depend on an
    element's position in the stream allow that (see DatasetDef.order_sensitive).
    """
    policy = task.sharding_policy
    if policy == ShardingPolicy.FILE_OR_DATA:
        policy = ShardingPolicy.FILE if dataset.file_based else ShardingPolicy.DATA
    if policy == ShardingPolicy.DYNAMIC:
        return ShardingPlan(_copies(ReplicaPlan(use_splits=True), num_executors))
    if policy == ShardingPolicy.OFF:
        if dataset.splittable and not dataset.order_sensitive and num_executors > 1:
            return ShardingPlan(_copies(ReplicaPlan(use_splits=True), num_executors),
                                local_splits=True)
        return ShardingPlan((ReplicaPlan(),))
    n, i = task.num_workers, task.worker_index
    if policy == ShardingPolicy.FILE:
        here = Rewrite(RewriteKind.FILES, n, i)
        if dataset.order_sensitive:
            return ShardingPlan((ReplicaPlan((here,)),))
        count = max(1, min(num_executors, len(range(i, dataset.num_files, n))))
        return ShardingPlan(tuple(ReplicaPlan((here, Rewrite(RewriteKind.FILES, count, j)))
                                  for j in range(count)))
    if policy == ShardingPolicy.DATA:
        return ShardingPlan((ReplicaPlan((Rewrite(RewriteKind.DATA, n, i),)),))
    if policy == ShardingPolicy.HINT:
        return ShardingPlan((ReplicaPlan((Rewrite(RewriteKind.HINTS, n, i),)),))
    raise ValueError(f"unknown sharding policy {policy}")


def _copies(plan: ReplicaPlan, count: int) -> tuple[ReplicaPlan, ...]:
    return tuple(plan for _ in range(count))

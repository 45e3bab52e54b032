"""The public reading API: register_dataset, from_dataset_id, distribute (tf.data service's)."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from torch_dataservice.observability.client import ClientStats, current_sink
from torch_dataservice.pipeline import Pipeline, pickling, shared_objects
from torch_dataservice.policies import TARGET_WORKERS, ShardingPolicy
from torch_dataservice.proto import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc
from torch_dataservice.rpc import channel_to, parse_service, retry, rpc_error_to_exception

_MODE_STRINGS = {"parallel_epochs": ShardingPolicy.OFF, "distributed_epoch": ShardingPolicy.DYNAMIC}
_COMPRESSIONS = ("AUTO", None)


def connect_timeout_s() -> float:
    """How long registering or joining a job may wait for the dispatcher."""
    return float(os.environ.get("TORCH_DATASERVICE_CONNECT_TIMEOUT_S", "60"))


@dataclass(frozen=True)
class CrossTrainerCache:
    """Share one job's elements among trainers; each `trainer_id` reads each element once."""

    trainer_id: str

    def __post_init__(self) -> None:
        if not isinstance(self.trainer_id, str) or not self.trainer_id:
            raise ValueError(
                f"CrossTrainerCache.trainer_id must be a non-empty string, got {self.trainer_id!r}"
            )


def parse_processing_mode(processing_mode: Any) -> ShardingPolicy:
    if isinstance(processing_mode, str) and processing_mode in _MODE_STRINGS:
        return _MODE_STRINGS[processing_mode]
    if isinstance(processing_mode, ShardingPolicy):
        return processing_mode
    if isinstance(processing_mode, int) and not isinstance(processing_mode, bool):
        try:
            return ShardingPolicy(processing_mode)
        except ValueError:
            pass
    accepted = ", ".join([*(f"ShardingPolicy.{p.name}" for p in ShardingPolicy),
                          *(repr(s) for s in _MODE_STRINGS)])
    raise ValueError(f"processing_mode {processing_mode!r} is not one of {accepted}")


@dataclass(frozen=True)
class ReadOptions:
    """Everything a reader of the service was asked for, validated at construction."""

    policy: ShardingPolicy
    address: str
    job_name: str | None
    consumer_index: int | None
    num_consumers: int | None
    max_outstanding_requests: int | None
    cross_trainer_cache: CrossTrainerCache | None
    target_workers: str

    @classmethod
    def build(cls, processing_mode: Any, service: Any, job_name: str | None,
              consumer_index: int | None, num_consumers: int | None,
              max_outstanding_requests: int | None,
              cross_trainer_cache: CrossTrainerCache | None,
              target_workers: str) -> ReadOptions:
        policy = parse_processing_mode(processing_mode)
        _, address = parse_service(service)
        if job_name is not None and (not isinstance(job_name, str) or not job_name):
            raise ValueError(f"job_name must be a non-empty string or None, got {job_name!r}")
        if (consumer_index is None) != (num_consumers is None):
            raise ValueError(
                "consumer_index and num_consumers must be given together, got "
                f"consumer_index={consumer_index!r}, num_consumers={num_consumers!r}")
        if num_consumers is not None:
            if job_name is None:
                raise ValueError(
                    f"num_consumers={num_consumers!r} needs a job_name (coordinated reads "
                    "share one job)")
            if not isinstance(num_consumers, int) or num_consumers <= 0:
                raise ValueError(f"num_consumers must be a positive int, got {num_consumers!r}")
            if not isinstance(consumer_index, int) or not 0 <= consumer_index < num_consumers:
                raise ValueError(
                    f"consumer_index must be in [0, {num_consumers}), got {consumer_index!r}")
        if max_outstanding_requests is not None and (
                not isinstance(max_outstanding_requests, int) or max_outstanding_requests <= 0):
            raise ValueError("max_outstanding_requests must be a positive int, "
                             f"got {max_outstanding_requests!r}")
        if cross_trainer_cache is not None:
            if not isinstance(cross_trainer_cache, CrossTrainerCache):
                raise ValueError(
                    f"cross_trainer_cache must be a CrossTrainerCache, got {cross_trainer_cache!r}")
            if job_name is None:
                raise ValueError("cross_trainer_cache needs a job_name (trainers share one job)")
        if target_workers not in TARGET_WORKERS:
            raise ValueError(
                f"target_workers must be one of {TARGET_WORKERS}, got {target_workers!r}")
        return cls(policy, address, job_name, consumer_index, num_consumers,
                   max_outstanding_requests, cross_trainer_cache, target_workers)

    def job_config(self, dataset_id: str, job_name: str) -> common_pb2.JobConfig:
        config = common_pb2.JobConfig(
            dataset_id=dataset_id, job_name=job_name, sharding_policy=int(self.policy),
            target_workers=self.target_workers,
            cross_trainer_cache=self.cross_trainer_cache is not None)
        if self.num_consumers is not None:
            config.num_consumers = self.num_consumers
        return config


def _check_compression(compression: Any) -> None:
    if compression not in _COMPRESSIONS:
        raise ValueError(f"compression must be 'AUTO' or None, got {compression!r}")


# Transformations whose output depends on an element's position in the whole stream: a worker
# cannot divide such a pipeline among its executor processes without changing the result.
_ORDER_SENSITIVE = frozenset({"Take", "Skip", "Shard"})


def _is_order_sensitive(pipeline: Pipeline) -> bool:
    return any(type(t).__name__ in _ORDER_SENSITIVE for t in pipeline.transforms)


def dataset_def(pipeline: Pipeline, compression: str | None) -> common_pb2.DatasetDef:
    """What the dispatcher keeps of a pipeline: its bytes and facts it cannot unpickle itself."""
    if not isinstance(pipeline, Pipeline):
        raise ValueError(f"dataset must be a torch_dataservice.Pipeline, got {type(pipeline)!r}")
    with shared_objects.collecting() as depends_on:
        data = pickling.dumps(pipeline, "pipeline")  # an error names what cannot be pickled
    definition = common_pb2.DatasetDef(
        pipeline=data,
        compression=compression or "",
        splittable=pipeline.is_splittable,
        num_splits=pipeline.num_splits if pipeline.is_splittable else 0,
        file_based=pipeline.is_file_based,
        num_files=len(pipeline.files) if pipeline.is_file_based else 0,
        has_shard_hint=pipeline.has_shard_hint,
        order_sensitive=_is_order_sensitive(pipeline),
        depends_on=list(dict.fromkeys(depends_on)),
    )
    definition.fingerprint = hashlib.sha256(
        data + (compression or "").encode()).hexdigest()
    return definition


def shared_object_def(obj: Any) -> common_pb2.DatasetDef:
    """A dataset holding `obj` for pipelines to refer to (pipeline/shared_objects.py)."""
    with shared_objects.collecting() as depends_on:
        data = pickling.dumps(obj)
    return common_pb2.DatasetDef(
        pipeline=data, shared_object=True, depends_on=list(dict.fromkeys(depends_on)),
        fingerprint="shared:" + hashlib.sha256(data).hexdigest())


def register_definition(service: Any, definition: common_pb2.DatasetDef,
                        dataset_id: str | None = None) -> str:
    """Register an already built `DatasetDef`; returns its dataset id."""
    _, address = parse_service(service)
    request = dispatcher_pb2.GetOrRegisterDatasetRequest(
        dataset=definition, dataset_id=dataset_id or "")
    stub = _dispatcher(address)
    try:
        response = retry(lambda: stub.GetOrRegisterDataset(request, timeout=30),
                         description=f"registering a dataset with the dispatcher at {address}",
                         deadline_s=connect_timeout_s())
    except grpc.RpcError as error:
        if (error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                and "larger than max" in (error.details() or "")):
            raise ValueError(
                f"the dataset definition is {definition.ByteSize()} bytes, more than the "
                f"dispatcher at {address} accepts (DispatcherConfig.max_dataset_bytes, "
                f"--max-dataset-bytes): {error.details()}") from None
        raise
    return response.dataset_id


def split_sizes(service: Any, iteration_id: int,
                keys: list[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """The element counts the dispatcher knows among the splits `keys` ((repetition, index))
    of `iteration_id`: those a worker finished producing (GetSplitSizes)."""
    _, address = parse_service(service)
    request = dispatcher_pb2.GetSplitSizesRequest(
        iteration_id=iteration_id,
        splits=[common_pb2.SplitKey(repetition=r, index=i) for r, i in keys])
    stub = _dispatcher(address)
    response = retry(lambda: stub.GetSplitSizes(request, timeout=30),
                     description=f"asking the dispatcher at {address} for split sizes",
                     deadline_s=connect_timeout_s())
    return {(s.split.repetition, s.split.index): s.num_elements for s in response.sizes}


def _dispatcher(address: str) -> dispatcher_pb2_grpc.DispatcherServiceStub:
    return dispatcher_pb2_grpc.DispatcherServiceStub(channel_to(address))


def register_dataset(service: Any, dataset: Pipeline, compression: str | None = "AUTO",
                     dataset_id: str | None = None) -> str:
    """Register `dataset` with the dispatcher at `service`; returns its dataset id.

    The same pipeline registered twice gets the same id; an explicit `dataset_id` that already
    exists is reused.
    """
    _, address = parse_service(service)
    _check_compression(compression)
    if dataset_id is not None and (not isinstance(dataset_id, str) or not dataset_id):
        raise ValueError(f"dataset_id must be a non-empty string or None, got {dataset_id!r}")
    definition = dataset_def(dataset, compression)
    try:
        return register_definition(address, definition, dataset_id)
    except grpc.RpcError as error:  # a refusal (too big, too many, a dependency gone): why
        raise rpc_error_to_exception(error, "registering a dataset") from None


class ServiceSource:
    """The local source of a Pipeline read through the service.

    Each call opens the next iteration: this object's k-th iteration joins iteration k of a
    named job, so readers of the same job name share each epoch, while iterating again starts
    the next one. Without a job name every iteration is an anonymous, exclusive job.

    A pass over a shared job may be empty because the job's other readers consumed it: a
    `repeat()` after `distribute()` goes on then (`empty_pass_ends`), and the next pass joins
    the job's latest iteration at least, so a late joiner does not walk through every epoch
    the others finished.
    """

    def __init__(self, options: ReadOptions, dataset_id: str, job_name: str | None) -> None:
        self._options = options
        self._dataset_id = dataset_id
        self._job_name = job_name
        self._iterations = 0
        self._next_repetition = 0
        self._last_pass_created = True
        self._catch_up = False  # the last pass joined an iteration others had consumed
        self._lock = threading.Lock()
        self._stats: ClientStats | None = None  # every iteration's figures, made when read

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_lock"]
        state["_stats"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def stats(self) -> dict[str, Any]:
        """What this Pipeline's reads received and waited, over all its iterations."""
        return (self._stats or ClientStats()).as_dict()

    def __call__(self) -> Iterator[Any]:
        from torch_dataservice.client.reader import IterationReader

        with self._lock:
            first = self._iterations == 0
            self._iterations += 1
            repetition = self._next_repetition
            self._next_repetition += 1
            catch_up, self._catch_up = self._catch_up, False
            if self._stats is None and current_sink() is None:
                self._stats = ClientStats()
        if not first and self._options.cross_trainer_cache is not None:
            # As tf.data service: the cache job is infinite and shared by trainer ids; a second
            # iteration would be a new job iteration whose cache starts at 0, so trainers on
            # different passes would silently stop sharing elements.
            raise ValueError(
                f"a reader with cross_trainer_cache (trainer_id="
                f"{self._options.cross_trainer_cache.trainer_id!r}) may be iterated only once: "
                "its job is infinite, so keep iterating the first iterator instead of calling "
                "iter() again (a repeat() after distribute() iterates again too)")
        named = self._job_name is not None
        config = self._options.job_config(self._dataset_id, self._job_name or "")
        reader = IterationReader(
            self._options.address, config, repetition if named else 0,
            self._options.max_outstanding_requests, connect_timeout_s(),
            trainer_id=(self._options.cross_trainer_cache.trainer_id
                        if self._options.cross_trainer_cache else ""),
            consumer_index=self._options.consumer_index,
            at_least_latest=catch_up and self._options.consumer_index is None,
            stats=self._stats)
        with self._lock:
            self._next_repetition = max(self._next_repetition, reader.repetition + 1)
            self._last_pass_created = reader.created_iteration or not named
        empty = True
        try:
            for element in reader:
                empty = False
                yield element
        finally:
            reader.close()
            if empty and not self._last_pass_created:
                with self._lock:
                    self._catch_up = True


    def empty_pass_ends(self) -> bool:
        """Whether the last pass, if it was empty, means the dataset is empty: not when it
        joined a shared iteration that other readers had consumed."""
        with self._lock:
            return self._last_pass_created


def reader_stats(pipeline: Pipeline) -> dict[str, Any] | None:
    """The figures of a Pipeline read through the service (`distribute`, `from_dataset_id`):
    batches (elements taken), elements and bytes received, seconds waiting, per worker; None
    for a pipeline that does not read the service."""
    factory = getattr(pipeline.source, "factory", None)
    return factory.stats() if isinstance(factory, ServiceSource) else None


def from_dataset_id(processing_mode: Any, service: Any, dataset_id: str,
                    job_name: str | None = None, consumer_index: int | None = None,
                    num_consumers: int | None = None,
                    max_outstanding_requests: int | None = None,
                    cross_trainer_cache: CrossTrainerCache | None = None,
                    target_workers: str = "AUTO") -> Pipeline:
    """A Pipeline reading the registered dataset `dataset_id` through the service."""
    options = ReadOptions.build(processing_mode, service, job_name, consumer_index,
                                num_consumers, max_outstanding_requests, cross_trainer_cache,
                                target_workers)
    if not isinstance(dataset_id, str) or not dataset_id:
        raise ValueError(f"dataset_id must be a non-empty string, got {dataset_id!r}")
    # Job names are scoped by dataset so one name cannot silently read another dataset.
    scoped = f"{dataset_id}/{job_name}" if job_name is not None else None
    return Pipeline.from_iterable(ServiceSource(options, dataset_id, scoped))


def distribute(processing_mode: Any, service: Any, job_name: str | None = None,
               consumer_index: int | None = None, num_consumers: int | None = None,
               max_outstanding_requests: int | None = None, compression: str | None = "AUTO",
               cross_trainer_cache: CrossTrainerCache | None = None,
               target_workers: str = "AUTO") -> Callable[[Pipeline], Pipeline]:
    """`pipeline.apply(distribute(...))`: run `pipeline` on the service's workers.

    Transformations applied after it run in the reading process.
    """
    options = ReadOptions.build(processing_mode, service, job_name, consumer_index,
                                num_consumers, max_outstanding_requests, cross_trainer_cache,
                                target_workers)
    _check_compression(compression)

    def apply(pipeline: Pipeline) -> Pipeline:
        # As at registration in tf.data service: refuse a pipeline the policy cannot divide.
        if (options.policy == ShardingPolicy.DYNAMIC and isinstance(pipeline, Pipeline)
                and not pipeline.is_splittable):
            raise ValueError(
                "sharding policy DYNAMIC needs a splittable source (range, from_items, "
                f"list_files or from_dataset), got {pipeline.source.describe()}")
        dataset_id = register_dataset(service, pipeline, compression=compression)
        return Pipeline.from_iterable(ServiceSource(options, dataset_id, job_name))

    return apply

from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerLoad(_message.Message):
    __slots__ = ("elements_sent", "bytes_sent", "buffered_elements", "elements_produced", "busy_seconds", "processes", "cache_bytes", "cache_hits", "cache_misses", "cache_evictions")
    ELEMENTS_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    ELEMENTS_PRODUCED_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    elements_sent: int
    bytes_sent: int
    buffered_elements: int
    elements_produced: int
    busy_seconds: float
    processes: int
    cache_bytes: int
    cache_hits: int
    cache_misses: int
    cache_evictions: int
    def __init__(self, elements_sent: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., buffered_elements: _Optional[int] = ..., elements_produced: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., processes: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., cache_hits: _Optional[int] = ..., cache_misses: _Optional[int] = ..., cache_evictions: _Optional[int] = ...) -> None: ...

class ClientLoad(_message.Message):
    __slots__ = ("rank", "batches", "wait_seconds", "elements", "bytes")
    RANK_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    batches: int
    wait_seconds: float
    elements: int
    bytes: int
    def __init__(self, rank: _Optional[int] = ..., batches: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., elements: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class GetClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetClusterStatusResponse(_message.Message):
    __slots__ = ("uptime_s", "version", "protocol", "workers", "iterations", "clients", "load")
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    uptime_s: float
    version: str
    protocol: str
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    iterations: _containers.RepeatedCompositeFieldContainer[IterationStatus]
    clients: _containers.RepeatedCompositeFieldContainer[ClientStatus]
    load: DispatcherLoad
    def __init__(self, uptime_s: _Optional[float] = ..., version: _Optional[str] = ..., protocol: _Optional[str] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., iterations: _Optional[_Iterable[_Union[IterationStatus, _Mapping]]] = ..., clients: _Optional[_Iterable[_Union[ClientStatus, _Mapping]]] = ..., load: _Optional[_Union[DispatcherLoad, _Mapping]] = ...) -> None: ...

class DispatcherLoad(_message.Message):
    __slots__ = ("cores", "rpcs_per_s", "refused_per_s", "worker_heartbeat_ms", "client_heartbeat_ms", "stretch")
    CORES_FIELD_NUMBER: _ClassVar[int]
    RPCS_PER_S_FIELD_NUMBER: _ClassVar[int]
    REFUSED_PER_S_FIELD_NUMBER: _ClassVar[int]
    WORKER_HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    STRETCH_FIELD_NUMBER: _ClassVar[int]
    cores: float
    rpcs_per_s: float
    refused_per_s: float
    worker_heartbeat_ms: int
    client_heartbeat_ms: int
    stretch: float
    def __init__(self, cores: _Optional[float] = ..., rpcs_per_s: _Optional[float] = ..., refused_per_s: _Optional[float] = ..., worker_heartbeat_ms: _Optional[int] = ..., client_heartbeat_ms: _Optional[int] = ..., stretch: _Optional[float] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("address", "state", "heartbeat_age_s", "tasks", "elements_per_s", "bytes_per_s", "elements_sent", "bytes_sent", "buffered_elements", "capacity_per_s", "cache_bytes", "cache_hits", "cache_misses", "cache_evictions", "held_splits")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    ELEMENTS_PER_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    ELEMENTS_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BUFFERED_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_PER_S_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    HELD_SPLITS_FIELD_NUMBER: _ClassVar[int]
    address: str
    state: str
    heartbeat_age_s: float
    tasks: int
    elements_per_s: float
    bytes_per_s: float
    elements_sent: int
    bytes_sent: int
    buffered_elements: int
    capacity_per_s: float
    cache_bytes: int
    cache_hits: int
    cache_misses: int
    cache_evictions: int
    held_splits: int
    def __init__(self, address: _Optional[str] = ..., state: _Optional[str] = ..., heartbeat_age_s: _Optional[float] = ..., tasks: _Optional[int] = ..., elements_per_s: _Optional[float] = ..., bytes_per_s: _Optional[float] = ..., elements_sent: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., buffered_elements: _Optional[int] = ..., capacity_per_s: _Optional[float] = ..., cache_bytes: _Optional[int] = ..., cache_hits: _Optional[int] = ..., cache_misses: _Optional[int] = ..., cache_evictions: _Optional[int] = ..., held_splits: _Optional[int] = ...) -> None: ...

class IterationStatus(_message.Message):
    __slots__ = ("iteration_id", "job_id", "dataset_id", "job_name", "mode", "clients", "num_consumers", "splits_handed", "splits_done", "elements_delivered", "finished", "tasks", "optimal_workers", "repetition")
    ITERATION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    NUM_CONSUMERS_FIELD_NUMBER: _ClassVar[int]
    SPLITS_HANDED_FIELD_NUMBER: _ClassVar[int]
    SPLITS_DONE_FIELD_NUMBER: _ClassVar[int]
    ELEMENTS_DELIVERED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    OPTIMAL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_FIELD_NUMBER: _ClassVar[int]
    iteration_id: int
    job_id: int
    dataset_id: str
    job_name: str
    mode: str
    clients: int
    num_consumers: int
    splits_handed: int
    splits_done: int
    elements_delivered: int
    finished: bool
    tasks: int
    optimal_workers: int
    repetition: int
    def __init__(self, iteration_id: _Optional[int] = ..., job_id: _Optional[int] = ..., dataset_id: _Optional[str] = ..., job_name: _Optional[str] = ..., mode: _Optional[str] = ..., clients: _Optional[int] = ..., num_consumers: _Optional[int] = ..., splits_handed: _Optional[int] = ..., splits_done: _Optional[int] = ..., elements_delivered: _Optional[int] = ..., finished: _Optional[bool] = ..., tasks: _Optional[int] = ..., optimal_workers: _Optional[int] = ..., repetition: _Optional[int] = ...) -> None: ...

class ClientStatus(_message.Message):
    __slots__ = ("client_id", "iteration_id", "rank", "batches", "wait_seconds", "wait_fraction", "wait_per_batch_s", "batches_per_s", "heartbeat_age_s")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_FRACTION_FIELD_NUMBER: _ClassVar[int]
    WAIT_PER_BATCH_S_FIELD_NUMBER: _ClassVar[int]
    BATCHES_PER_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    iteration_id: int
    rank: int
    batches: int
    wait_seconds: float
    wait_fraction: float
    wait_per_batch_s: float
    batches_per_s: float
    heartbeat_age_s: float
    def __init__(self, client_id: _Optional[int] = ..., iteration_id: _Optional[int] = ..., rank: _Optional[int] = ..., batches: _Optional[int] = ..., wait_seconds: _Optional[float] = ..., wait_fraction: _Optional[float] = ..., wait_per_batch_s: _Optional[float] = ..., batches_per_s: _Optional[float] = ..., heartbeat_age_s: _Optional[float] = ...) -> None: ...

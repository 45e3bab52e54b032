from torch_dataservice.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DispatcherSnapshot(_message.Message):
    __slots__ = ("schema_version", "datasets", "dataset_by_fingerprint", "workers", "jobs", "job_by_name", "iterations", "iteration_by_key", "tasks", "clients", "next_ids")
    class Dataset(_message.Message):
        __slots__ = ("dataset_id", "definition")
        DATASET_ID_FIELD_NUMBER: _ClassVar[int]
        DEFINITION_FIELD_NUMBER: _ClassVar[int]
        dataset_id: str
        definition: _common_pb2.DatasetDef
        def __init__(self, dataset_id: _Optional[str] = ..., definition: _Optional[_Union[_common_pb2.DatasetDef, _Mapping]] = ...) -> None: ...
    class Worker(_message.Message):
        __slots__ = ("address", "uid", "index", "host_id", "process_id", "task_ids", "data_port", "data_socket")
        ADDRESS_FIELD_NUMBER: _ClassVar[int]
        UID_FIELD_NUMBER: _ClassVar[int]
        INDEX_FIELD_NUMBER: _ClassVar[int]
        HOST_ID_FIELD_NUMBER: _ClassVar[int]
        PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
        TASK_IDS_FIELD_NUMBER: _ClassVar[int]
        DATA_PORT_FIELD_NUMBER: _ClassVar[int]
        DATA_SOCKET_FIELD_NUMBER: _ClassVar[int]
        address: str
        uid: int
        index: int
        host_id: str
        process_id: str
        task_ids: _containers.RepeatedScalarFieldContainer[int]
        data_port: int
        data_socket: str
        def __init__(self, address: _Optional[str] = ..., uid: _Optional[int] = ..., index: _Optional[int] = ..., host_id: _Optional[str] = ..., process_id: _Optional[str] = ..., task_ids: _Optional[_Iterable[int]] = ..., data_port: _Optional[int] = ..., data_socket: _Optional[str] = ...) -> None: ...
    class Job(_message.Message):
        __slots__ = ("job_id", "name", "config")
        JOB_ID_FIELD_NUMBER: _ClassVar[int]
        NAME_FIELD_NUMBER: _ClassVar[int]
        CONFIG_FIELD_NUMBER: _ClassVar[int]
        job_id: int
        name: str
        config: _common_pb2.JobConfig
        def __init__(self, job_id: _Optional[int] = ..., name: _Optional[str] = ..., config: _Optional[_Union[_common_pb2.JobConfig, _Mapping]] = ...) -> None: ...
    class LastSplit(_message.Message):
        __slots__ = ("replica", "request_id", "splits")
        REPLICA_FIELD_NUMBER: _ClassVar[int]
        REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
        SPLITS_FIELD_NUMBER: _ClassVar[int]
        replica: int
        request_id: int
        splits: _containers.RepeatedCompositeFieldContainer[_common_pb2.SplitKey]
        def __init__(self, replica: _Optional[int] = ..., request_id: _Optional[int] = ..., splits: _Optional[_Iterable[_Union[_common_pb2.SplitKey, _Mapping]]] = ...) -> None: ...
    class Task(_message.Message):
        __slots__ = ("task_id", "iteration_id", "worker_address", "starting_round", "finished", "lost", "splits", "last_split", "split_repetitions", "split_indices")
        TASK_ID_FIELD_NUMBER: _ClassVar[int]
        ITERATION_ID_FIELD_NUMBER: _ClassVar[int]
        WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
        STARTING_ROUND_FIELD_NUMBER: _ClassVar[int]
        FINISHED_FIELD_NUMBER: _ClassVar[int]
        LOST_FIELD_NUMBER: _ClassVar[int]
        SPLITS_FIELD_NUMBER: _ClassVar[int]
        LAST_SPLIT_FIELD_NUMBER: _ClassVar[int]
        SPLIT_REPETITIONS_FIELD_NUMBER: _ClassVar[int]
        SPLIT_INDICES_FIELD_NUMBER: _ClassVar[int]
        task_id: int
        iteration_id: int
        worker_address: str
        starting_round: int
        finished: bool
        lost: bool
        splits: _containers.RepeatedCompositeFieldContainer[_common_pb2.SplitKey]
        last_split: _containers.RepeatedCompositeFieldContainer[DispatcherSnapshot.LastSplit]
        split_repetitions: _containers.RepeatedScalarFieldContainer[int]
        split_indices: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, task_id: _Optional[int] = ..., iteration_id: _Optional[int] = ..., worker_address: _Optional[str] = ..., starting_round: _Optional[int] = ..., finished: _Optional[bool] = ..., lost: _Optional[bool] = ..., splits: _Optional[_Iterable[_Union[_common_pb2.SplitKey, _Mapping]]] = ..., last_split: _Optional[_Iterable[_Union[DispatcherSnapshot.LastSplit, _Mapping]]] = ..., split_repetitions: _Optional[_Iterable[int]] = ..., split_indices: _Optional[_Iterable[int]] = ...) -> None: ...
    class RequeuedSplit(_message.Message):
        __slots__ = ("split", "delivered_offsets")
        SPLIT_FIELD_NUMBER: _ClassVar[int]
        DELIVERED_OFFSETS_FIELD_NUMBER: _ClassVar[int]
        split: _common_pb2.SplitKey
        delivered_offsets: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, split: _Optional[_Union[_common_pb2.SplitKey, _Mapping]] = ..., delivered_offsets: _Optional[_Iterable[int]] = ...) -> None: ...
    class DeliveredSplit(_message.Message):
        __slots__ = ("split", "offsets")
        SPLIT_FIELD_NUMBER: _ClassVar[int]
        OFFSETS_FIELD_NUMBER: _ClassVar[int]
        split: _common_pb2.SplitKey
        offsets: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, split: _Optional[_Union[_common_pb2.SplitKey, _Mapping]] = ..., offsets: _Optional[_Iterable[int]] = ...) -> None: ...
    class ProducedSplit(_message.Message):
        __slots__ = ("split", "num_elements")
        SPLIT_FIELD_NUMBER: _ClassVar[int]
        NUM_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
        split: _common_pb2.SplitKey
        num_elements: int
        def __init__(self, split: _Optional[_Union[_common_pb2.SplitKey, _Mapping]] = ..., num_elements: _Optional[int] = ...) -> None: ...
    class Iteration(_message.Message):
        __slots__ = ("iteration_id", "job_id", "repetition", "task_ids", "client_ids", "garbage_collected", "cursor_repetition", "cursor_index", "requeued", "delivered", "produced", "removals", "sizes", "ahead", "size_runs", "delivered_repetitions", "delivered_indices", "delivered_offset_counts", "delivered_offsets", "produced_repetitions", "produced_indices", "produced_elements")
        ITERATION_ID_FIELD_NUMBER: _ClassVar[int]
        JOB_ID_FIELD_NUMBER: _ClassVar[int]
        REPETITION_FIELD_NUMBER: _ClassVar[int]
        TASK_IDS_FIELD_NUMBER: _ClassVar[int]
        CLIENT_IDS_FIELD_NUMBER: _ClassVar[int]
        GARBAGE_COLLECTED_FIELD_NUMBER: _ClassVar[int]
        CURSOR_REPETITION_FIELD_NUMBER: _ClassVar[int]
        CURSOR_INDEX_FIELD_NUMBER: _ClassVar[int]
        REQUEUED_FIELD_NUMBER: _ClassVar[int]
        DELIVERED_FIELD_NUMBER: _ClassVar[int]
        PRODUCED_FIELD_NUMBER: _ClassVar[int]
        REMOVALS_FIELD_NUMBER: _ClassVar[int]
        SIZES_FIELD_NUMBER: _ClassVar[int]
        AHEAD_FIELD_NUMBER: _ClassVar[int]
        SIZE_RUNS_FIELD_NUMBER: _ClassVar[int]
        DELIVERED_REPETITIONS_FIELD_NUMBER: _ClassVar[int]
        DELIVERED_INDICES_FIELD_NUMBER: _ClassVar[int]
        DELIVERED_OFFSET_COUNTS_FIELD_NUMBER: _ClassVar[int]
        DELIVERED_OFFSETS_FIELD_NUMBER: _ClassVar[int]
        PRODUCED_REPETITIONS_FIELD_NUMBER: _ClassVar[int]
        PRODUCED_INDICES_FIELD_NUMBER: _ClassVar[int]
        PRODUCED_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
        iteration_id: int
        job_id: int
        repetition: int
        task_ids: _containers.RepeatedScalarFieldContainer[int]
        client_ids: _containers.RepeatedScalarFieldContainer[int]
        garbage_collected: bool
        cursor_repetition: int
        cursor_index: int
        requeued: _containers.RepeatedCompositeFieldContainer[DispatcherSnapshot.RequeuedSplit]
        delivered: _containers.RepeatedCompositeFieldContainer[DispatcherSnapshot.DeliveredSplit]
        produced: _containers.RepeatedCompositeFieldContainer[DispatcherSnapshot.ProducedSplit]
        removals: _containers.RepeatedCompositeFieldContainer[_common_pb2.RemovedTasks]
        sizes: _containers.RepeatedCompositeFieldContainer[DispatcherSnapshot.ProducedSplit]
        ahead: _containers.RepeatedScalarFieldContainer[int]
        size_runs: _containers.RepeatedCompositeFieldContainer[DispatcherSnapshot.SizeRun]
        delivered_repetitions: _containers.RepeatedScalarFieldContainer[int]
        delivered_indices: _containers.RepeatedScalarFieldContainer[int]
        delivered_offset_counts: _containers.RepeatedScalarFieldContainer[int]
        delivered_offsets: _containers.RepeatedScalarFieldContainer[int]
        produced_repetitions: _containers.RepeatedScalarFieldContainer[int]
        produced_indices: _containers.RepeatedScalarFieldContainer[int]
        produced_elements: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, iteration_id: _Optional[int] = ..., job_id: _Optional[int] = ..., repetition: _Optional[int] = ..., task_ids: _Optional[_Iterable[int]] = ..., client_ids: _Optional[_Iterable[int]] = ..., garbage_collected: _Optional[bool] = ..., cursor_repetition: _Optional[int] = ..., cursor_index: _Optional[int] = ..., requeued: _Optional[_Iterable[_Union[DispatcherSnapshot.RequeuedSplit, _Mapping]]] = ..., delivered: _Optional[_Iterable[_Union[DispatcherSnapshot.DeliveredSplit, _Mapping]]] = ..., produced: _Optional[_Iterable[_Union[DispatcherSnapshot.ProducedSplit, _Mapping]]] = ..., removals: _Optional[_Iterable[_Union[_common_pb2.RemovedTasks, _Mapping]]] = ..., sizes: _Optional[_Iterable[_Union[DispatcherSnapshot.ProducedSplit, _Mapping]]] = ..., ahead: _Optional[_Iterable[int]] = ..., size_runs: _Optional[_Iterable[_Union[DispatcherSnapshot.SizeRun, _Mapping]]] = ..., delivered_repetitions: _Optional[_Iterable[int]] = ..., delivered_indices: _Optional[_Iterable[int]] = ..., delivered_offset_counts: _Optional[_Iterable[int]] = ..., delivered_offsets: _Optional[_Iterable[int]] = ..., produced_repetitions: _Optional[_Iterable[int]] = ..., produced_indices: _Optional[_Iterable[int]] = ..., produced_elements: _Optional[_Iterable[int]] = ...) -> None: ...
    class SizeRun(_message.Message):
        __slots__ = ("repetition", "first", "end", "num_elements")
        REPETITION_FIELD_NUMBER: _ClassVar[int]
        FIRST_FIELD_NUMBER: _ClassVar[int]
        END_FIELD_NUMBER: _ClassVar[int]
        NUM_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
        repetition: int
        first: int
        end: int
        num_elements: int
        def __init__(self, repetition: _Optional[int] = ..., first: _Optional[int] = ..., end: _Optional[int] = ..., num_elements: _Optional[int] = ...) -> None: ...
    class FingerprintEntry(_message.Message):
        __slots__ = ("fingerprint", "dataset_id")
        FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
        DATASET_ID_FIELD_NUMBER: _ClassVar[int]
        fingerprint: str
        dataset_id: str
        def __init__(self, fingerprint: _Optional[str] = ..., dataset_id: _Optional[str] = ...) -> None: ...
    class JobNameEntry(_message.Message):
        __slots__ = ("name", "job_id")
        NAME_FIELD_NUMBER: _ClassVar[int]
        JOB_ID_FIELD_NUMBER: _ClassVar[int]
        name: str
        job_id: int
        def __init__(self, name: _Optional[str] = ..., job_id: _Optional[int] = ...) -> None: ...
    class IterationKeyEntry(_message.Message):
        __slots__ = ("job_id", "repetition", "iteration_id")
        JOB_ID_FIELD_NUMBER: _ClassVar[int]
        REPETITION_FIELD_NUMBER: _ClassVar[int]
        ITERATION_ID_FIELD_NUMBER: _ClassVar[int]
        job_id: int
        repetition: int
        iteration_id: int
        def __init__(self, job_id: _Optional[int] = ..., repetition: _Optional[int] = ..., iteration_id: _Optional[int] = ...) -> None: ...
    class ClientEntry(_message.Message):
        __slots__ = ("client_id", "iteration_id")
        CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
        ITERATION_ID_FIELD_NUMBER: _ClassVar[int]
        client_id: int
        iteration_id: int
        def __init__(self, client_id: _Optional[int] = ..., iteration_id: _Optional[int] = ...) -> None: ...
    class NextIdEntry(_message.Message):
        __slots__ = ("kind", "next_id")
        KIND_FIELD_NUMBER: _ClassVar[int]
        NEXT_ID_FIELD_NUMBER: _ClassVar[int]
        kind: str
        next_id: int
        def __init__(self, kind: _Optional[str] = ..., next_id: _Optional[int] = ...) -> None: ...
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    DATASET_BY_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    JOB_BY_NAME_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    ITERATION_BY_KEY_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_IDS_FIELD_NUMBER: _ClassVar[int]
    schema_version: int
    datasets: _containers.RepeatedCompositeFieldContainer[DispatcherSnapshot.Dataset]
    dataset_by_fingerprint: _containers.RepeatedCompositeFieldContainer[DispatcherSnapshot.FingerprintEntry]
    workers: _containers.RepeatedCompositeFieldContainer[DispatcherSnapshot.Worker]
    jobs: _containers.RepeatedCompositeFieldContainer[DispatcherSnapshot.Job]
    job_by_name: _containers.RepeatedCompositeFieldContainer[DispatcherSnapshot.JobNameEntry]
    iterations: _containers.RepeatedCompositeFieldContainer[DispatcherSnapshot.Iteration]
    iteration_by_key: _containers.RepeatedCompositeFieldContainer[DispatcherSnapshot.IterationKeyEntry]
    tasks: _containers.RepeatedCompositeFieldContainer[DispatcherSnapshot.Task]
    clients: _containers.RepeatedCompositeFieldContainer[DispatcherSnapshot.ClientEntry]
    next_ids: _containers.RepeatedCompositeFieldContainer[DispatcherSnapshot.NextIdEntry]
    def __init__(self, schema_version: _Optional[int] = ..., datasets: _Optional[_Iterable[_Union[DispatcherSnapshot.Dataset, _Mapping]]] = ..., dataset_by_fingerprint: _Optional[_Iterable[_Union[DispatcherSnapshot.FingerprintEntry, _Mapping]]] = ..., workers: _Optional[_Iterable[_Union[DispatcherSnapshot.Worker, _Mapping]]] = ..., jobs: _Optional[_Iterable[_Union[DispatcherSnapshot.Job, _Mapping]]] = ..., job_by_name: _Optional[_Iterable[_Union[DispatcherSnapshot.JobNameEntry, _Mapping]]] = ..., iterations: _Optional[_Iterable[_Union[DispatcherSnapshot.Iteration, _Mapping]]] = ..., iteration_by_key: _Optional[_Iterable[_Union[DispatcherSnapshot.IterationKeyEntry, _Mapping]]] = ..., tasks: _Optional[_Iterable[_Union[DispatcherSnapshot.Task, _Mapping]]] = ..., clients: _Optional[_Iterable[_Union[DispatcherSnapshot.ClientEntry, _Mapping]]] = ..., next_ids: _Optional[_Iterable[_Union[DispatcherSnapshot.NextIdEntry, _Mapping]]] = ...) -> None: ...

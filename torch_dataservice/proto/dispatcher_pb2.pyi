from torch_dataservice.proto import common_pb2 as _common_pb2
from torch_dataservice.proto import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetOrRegisterDatasetRequest(_message.Message):
    __slots__ = ("dataset", "dataset_id")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    dataset: _common_pb2.DatasetDef
    dataset_id: str
    def __init__(self, dataset: _Optional[_Union[_common_pb2.DatasetDef, _Mapping]] = ..., dataset_id: _Optional[str] = ...) -> None: ...

class GetOrRegisterDatasetResponse(_message.Message):
    __slots__ = ("dataset_id",)
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    dataset_id: str
    def __init__(self, dataset_id: _Optional[str] = ...) -> None: ...

class GetDatasetDefRequest(_message.Message):
    __slots__ = ("dataset_id",)
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    dataset_id: str
    def __init__(self, dataset_id: _Optional[str] = ...) -> None: ...

class GetDatasetDefResponse(_message.Message):
    __slots__ = ("dataset",)
    DATASET_FIELD_NUMBER: _ClassVar[int]
    dataset: _common_pb2.DatasetDef
    def __init__(self, dataset: _Optional[_Union[_common_pb2.DatasetDef, _Mapping]] = ...) -> None: ...

class GetOrCreateJobRequest(_message.Message):
    __slots__ = ("config", "build")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    BUILD_FIELD_NUMBER: _ClassVar[int]
    config: _common_pb2.JobConfig
    build: _common_pb2.BuildInfo
    def __init__(self, config: _Optional[_Union[_common_pb2.JobConfig, _Mapping]] = ..., build: _Optional[_Union[_common_pb2.BuildInfo, _Mapping]] = ...) -> None: ...

class GetOrCreateJobResponse(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    def __init__(self, job_id: _Optional[int] = ...) -> None: ...

class GetOrCreateIterationRequest(_message.Message):
    __slots__ = ("job_id", "repetition", "at_least_latest")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REPETITION_FIELD_NUMBER: _ClassVar[int]
    AT_LEAST_LATEST_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    repetition: int
    at_least_latest: bool
    def __init__(self, job_id: _Optional[int] = ..., repetition: _Optional[int] = ..., at_least_latest: _Optional[bool] = ...) -> None: ...

class GetOrCreateIterationResponse(_message.Message):
    __slots__ = ("iteration_id", "client_id", "repetition", "created", "next_heartbeat_ms")
    ITERATION_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    REPETITION_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    NEXT_HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    iteration_id: int
    client_id: int
    repetition: int
    created: bool
    next_heartbeat_ms: int
    def __init__(self, iteration_id: _Optional[int] = ..., client_id: _Optional[int] = ..., repetition: _Optional[int] = ..., created: _Optional[bool] = ..., next_heartbeat_ms: _Optional[int] = ...) -> None: ...

class ClientHeartbeatRequest(_message.Message):
    __slots__ = ("client_id", "current_round", "received", "blocked_round", "consumer_index", "removals_seen", "consumer_done", "fenced_tasks", "ready_round", "known_tasks_version", "load")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    CURRENT_ROUND_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BLOCKED_ROUND_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_INDEX_FIELD_NUMBER: _ClassVar[int]
    REMOVALS_SEEN_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_DONE_FIELD_NUMBER: _ClassVar[int]
    FENCED_TASKS_FIELD_NUMBER: _ClassVar[int]
    READY_ROUND_FIELD_NUMBER: _ClassVar[int]
    KNOWN_TASKS_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    current_round: int
    received: _containers.RepeatedCompositeFieldContainer[ReceivedSplit]
    blocked_round: int
    consumer_index: int
    removals_seen: int
    consumer_done: bool
    fenced_tasks: _containers.RepeatedScalarFieldContainer[int]
    ready_round: int
    known_tasks_version: int
    load: _status_pb2.ClientLoad
    def __init__(self, client_id: _Optional[int] = ..., current_round: _Optional[int] = ..., received: _Optional[_Iterable[_Union[ReceivedSplit, _Mapping]]] = ..., blocked_round: _Optional[int] = ..., consumer_index: _Optional[int] = ..., removals_seen: _Optional[int] = ..., consumer_done: _Optional[bool] = ..., fenced_tasks: _Optional[_Iterable[int]] = ..., ready_round: _Optional[int] = ..., known_tasks_version: _Optional[int] = ..., load: _Optional[_Union[_status_pb2.ClientLoad, _Mapping]] = ...) -> None: ...

class ReceivedSplit(_message.Message):
    __slots__ = ("task_id", "split", "offsets", "offset_ranges")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_RANGES_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    split: _common_pb2.SplitKey
    offsets: _containers.RepeatedScalarFieldContainer[int]
    offset_ranges: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, task_id: _Optional[int] = ..., split: _Optional[_Union[_common_pb2.SplitKey, _Mapping]] = ..., offsets: _Optional[_Iterable[int]] = ..., offset_ranges: _Optional[_Iterable[int]] = ...) -> None: ...

class ClientHeartbeatResponse(_message.Message):
    __slots__ = ("tasks", "iteration_finished", "error", "settled", "removals", "lost_task_ids", "addition_round", "declared_silent", "handed_again", "next_heartbeat_ms", "tasks_version", "tasks_unchanged")
    TASKS_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FINISHED_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    REMOVALS_FIELD_NUMBER: _ClassVar[int]
    LOST_TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    ADDITION_ROUND_FIELD_NUMBER: _ClassVar[int]
    DECLARED_SILENT_FIELD_NUMBER: _ClassVar[int]
    HANDED_AGAIN_FIELD_NUMBER: _ClassVar[int]
    NEXT_HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    TASKS_VERSION_FIELD_NUMBER: _ClassVar[int]
    TASKS_UNCHANGED_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedCompositeFieldContainer[_common_pb2.TaskInfo]
    iteration_finished: bool
    error: str
    settled: _containers.RepeatedCompositeFieldContainer[SettledSplit]
    removals: _containers.RepeatedCompositeFieldContainer[_common_pb2.RemovedTasks]
    lost_task_ids: _containers.RepeatedScalarFieldContainer[int]
    addition_round: int
    declared_silent: bool
    handed_again: _containers.RepeatedCompositeFieldContainer[_common_pb2.SplitKey]
    next_heartbeat_ms: int
    tasks_version: int
    tasks_unchanged: bool
    def __init__(self, tasks: _Optional[_Iterable[_Union[_common_pb2.TaskInfo, _Mapping]]] = ..., iteration_finished: _Optional[bool] = ..., error: _Optional[str] = ..., settled: _Optional[_Iterable[_Union[SettledSplit, _Mapping]]] = ..., removals: _Optional[_Iterable[_Union[_common_pb2.RemovedTasks, _Mapping]]] = ..., lost_task_ids: _Optional[_Iterable[int]] = ..., addition_round: _Optional[int] = ..., declared_silent: _Optional[bool] = ..., handed_again: _Optional[_Iterable[_Union[_common_pb2.SplitKey, _Mapping]]] = ..., next_heartbeat_ms: _Optional[int] = ..., tasks_version: _Optional[int] = ..., tasks_unchanged: _Optional[bool] = ...) -> None: ...

class SettledSplit(_message.Message):
    __slots__ = ("split", "num_elements")
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    NUM_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    split: _common_pb2.SplitKey
    num_elements: int
    def __init__(self, split: _Optional[_Union[_common_pb2.SplitKey, _Mapping]] = ..., num_elements: _Optional[int] = ...) -> None: ...

class GetSplitSizesRequest(_message.Message):
    __slots__ = ("iteration_id", "splits")
    ITERATION_ID_FIELD_NUMBER: _ClassVar[int]
    SPLITS_FIELD_NUMBER: _ClassVar[int]
    iteration_id: int
    splits: _containers.RepeatedCompositeFieldContainer[_common_pb2.SplitKey]
    def __init__(self, iteration_id: _Optional[int] = ..., splits: _Optional[_Iterable[_Union[_common_pb2.SplitKey, _Mapping]]] = ...) -> None: ...

class GetSplitSizesResponse(_message.Message):
    __slots__ = ("sizes",)
    SIZES_FIELD_NUMBER: _ClassVar[int]
    sizes: _containers.RepeatedCompositeFieldContainer[SettledSplit]
    def __init__(self, sizes: _Optional[_Iterable[_Union[SettledSplit, _Mapping]]] = ...) -> None: ...

class ReleaseIterationClientRequest(_message.Message):
    __slots__ = ("client_id", "received", "load")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    received: _containers.RepeatedCompositeFieldContainer[ReceivedSplit]
    load: _status_pb2.ClientLoad
    def __init__(self, client_id: _Optional[int] = ..., received: _Optional[_Iterable[_Union[ReceivedSplit, _Mapping]]] = ..., load: _Optional[_Union[_status_pb2.ClientLoad, _Mapping]] = ...) -> None: ...

class ReleaseIterationClientResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerHeartbeatRequest(_message.Message):
    __slots__ = ("worker_address", "worker_uid", "current_tasks", "host_id", "process_id", "data_port", "data_socket", "build", "leaving", "held_version", "held_report", "held", "load")
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_UID_FIELD_NUMBER: _ClassVar[int]
    CURRENT_TASKS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_SOCKET_FIELD_NUMBER: _ClassVar[int]
    BUILD_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    HELD_VERSION_FIELD_NUMBER: _ClassVar[int]
    HELD_REPORT_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    worker_address: str
    worker_uid: int
    current_tasks: _containers.RepeatedScalarFieldContainer[int]
    host_id: str
    process_id: str
    data_port: int
    data_socket: str
    build: _common_pb2.BuildInfo
    leaving: bool
    held_version: int
    held_report: bool
    held: _containers.RepeatedCompositeFieldContainer[HeldSplits]
    load: _status_pb2.WorkerLoad
    def __init__(self, worker_address: _Optional[str] = ..., worker_uid: _Optional[int] = ..., current_tasks: _Optional[_Iterable[int]] = ..., host_id: _Optional[str] = ..., process_id: _Optional[str] = ..., data_port: _Optional[int] = ..., data_socket: _Optional[str] = ..., build: _Optional[_Union[_common_pb2.BuildInfo, _Mapping]] = ..., leaving: _Optional[bool] = ..., held_version: _Optional[int] = ..., held_report: _Optional[bool] = ..., held: _Optional[_Iterable[_Union[HeldSplits, _Mapping]]] = ..., load: _Optional[_Union[_status_pb2.WorkerLoad, _Mapping]] = ...) -> None: ...

class HeldSplits(_message.Message):
    __slots__ = ("dataset_id", "ranges")
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    dataset_id: str
    ranges: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dataset_id: _Optional[str] = ..., ranges: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerHeartbeatResponse(_message.Message):
    __slots__ = ("new_tasks", "tasks_to_delete", "worker_index", "next_heartbeat_ms", "held_version")
    NEW_TASKS_FIELD_NUMBER: _ClassVar[int]
    TASKS_TO_DELETE_FIELD_NUMBER: _ClassVar[int]
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    NEXT_HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    HELD_VERSION_FIELD_NUMBER: _ClassVar[int]
    new_tasks: _containers.RepeatedCompositeFieldContainer[_common_pb2.TaskDef]
    tasks_to_delete: _containers.RepeatedScalarFieldContainer[int]
    worker_index: int
    next_heartbeat_ms: int
    held_version: int
    def __init__(self, new_tasks: _Optional[_Iterable[_Union[_common_pb2.TaskDef, _Mapping]]] = ..., tasks_to_delete: _Optional[_Iterable[int]] = ..., worker_index: _Optional[int] = ..., next_heartbeat_ms: _Optional[int] = ..., held_version: _Optional[int] = ...) -> None: ...

class WorkerUpdateRequest(_message.Message):
    __slots__ = ("worker_address", "completed_tasks")
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_TASKS_FIELD_NUMBER: _ClassVar[int]
    worker_address: str
    completed_tasks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_address: _Optional[str] = ..., completed_tasks: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerUpdateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetSplitRequest(_message.Message):
    __slots__ = ("iteration_id", "repetition", "task_id", "replica", "request_id", "finished_splits", "max_splits", "report_only")
    ITERATION_ID_FIELD_NUMBER: _ClassVar[int]
    REPETITION_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SPLITS_FIELD_NUMBER: _ClassVar[int]
    MAX_SPLITS_FIELD_NUMBER: _ClassVar[int]
    REPORT_ONLY_FIELD_NUMBER: _ClassVar[int]
    iteration_id: int
    repetition: int
    task_id: int
    replica: int
    request_id: int
    finished_splits: _containers.RepeatedCompositeFieldContainer[FinishedSplit]
    max_splits: int
    report_only: bool
    def __init__(self, iteration_id: _Optional[int] = ..., repetition: _Optional[int] = ..., task_id: _Optional[int] = ..., replica: _Optional[int] = ..., request_id: _Optional[int] = ..., finished_splits: _Optional[_Iterable[_Union[FinishedSplit, _Mapping]]] = ..., max_splits: _Optional[int] = ..., report_only: _Optional[bool] = ...) -> None: ...

class FinishedSplit(_message.Message):
    __slots__ = ("split", "elements")
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    split: _common_pb2.SplitKey
    elements: int
    def __init__(self, split: _Optional[_Union[_common_pb2.SplitKey, _Mapping]] = ..., elements: _Optional[int] = ...) -> None: ...

class GetSplitResponse(_message.Message):
    __slots__ = ("split_index", "end_of_splits", "skip", "skip_offsets", "repetition", "following", "split_cover_ms")
    SPLIT_INDEX_FIELD_NUMBER: _ClassVar[int]
    END_OF_SPLITS_FIELD_NUMBER: _ClassVar[int]
    SKIP_FIELD_NUMBER: _ClassVar[int]
    SKIP_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_FIELD_NUMBER: _ClassVar[int]
    FOLLOWING_FIELD_NUMBER: _ClassVar[int]
    SPLIT_COVER_MS_FIELD_NUMBER: _ClassVar[int]
    split_index: int
    end_of_splits: bool
    skip: int
    skip_offsets: _containers.RepeatedScalarFieldContainer[int]
    repetition: int
    following: _containers.RepeatedCompositeFieldContainer[GetSplitResponse]
    split_cover_ms: int
    def __init__(self, split_index: _Optional[int] = ..., end_of_splits: _Optional[bool] = ..., skip: _Optional[int] = ..., skip_offsets: _Optional[_Iterable[int]] = ..., repetition: _Optional[int] = ..., following: _Optional[_Iterable[_Union[GetSplitResponse, _Mapping]]] = ..., split_cover_ms: _Optional[int] = ...) -> None: ...

class Update(_message.Message):
    __slots__ = ("register_dataset", "register_worker", "create_job", "create_iteration", "produce_split", "create_task", "finish_task", "acquire_client", "release_client", "garbage_collect_iteration", "remove_worker", "requeue_split", "snapshot", "record_delivered", "split_produced", "remove_round_tasks", "remove_dataset", "skip_ids", "batch")
    REGISTER_DATASET_FIELD_NUMBER: _ClassVar[int]
    REGISTER_WORKER_FIELD_NUMBER: _ClassVar[int]
    CREATE_JOB_FIELD_NUMBER: _ClassVar[int]
    CREATE_ITERATION_FIELD_NUMBER: _ClassVar[int]
    PRODUCE_SPLIT_FIELD_NUMBER: _ClassVar[int]
    CREATE_TASK_FIELD_NUMBER: _ClassVar[int]
    FINISH_TASK_FIELD_NUMBER: _ClassVar[int]
    ACQUIRE_CLIENT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_CLIENT_FIELD_NUMBER: _ClassVar[int]
    GARBAGE_COLLECT_ITERATION_FIELD_NUMBER: _ClassVar[int]
    REMOVE_WORKER_FIELD_NUMBER: _ClassVar[int]
    REQUEUE_SPLIT_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    RECORD_DELIVERED_FIELD_NUMBER: _ClassVar[int]
    SPLIT_PRODUCED_FIELD_NUMBER: _ClassVar[int]
    REMOVE_ROUND_TASKS_FIELD_NUMBER: _ClassVar[int]
    REMOVE_DATASET_FIELD_NUMBER: _ClassVar[int]
    SKIP_IDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    register_dataset: RegisterDataset
    register_worker: RegisterWorker
    create_job: CreateJob
    create_iteration: CreateIteration
    produce_split: ProduceSplit
    create_task: CreateTask
    finish_task: FinishTask
    acquire_client: AcquireClient
    release_client: ReleaseClient
    garbage_collect_iteration: GarbageCollectIteration
    remove_worker: RemoveWorker
    requeue_split: RequeueSplit
    snapshot: StateSnapshot
    record_delivered: RecordDelivered
    split_produced: SplitProduced
    remove_round_tasks: RemoveRoundTasks
    remove_dataset: RemoveDataset
    skip_ids: SkipIds
    batch: UpdateBatch
    def __init__(self, register_dataset: _Optional[_Union[RegisterDataset, _Mapping]] = ..., register_worker: _Optional[_Union[RegisterWorker, _Mapping]] = ..., create_job: _Optional[_Union[CreateJob, _Mapping]] = ..., create_iteration: _Optional[_Union[CreateIteration, _Mapping]] = ..., produce_split: _Optional[_Union[ProduceSplit, _Mapping]] = ..., create_task: _Optional[_Union[CreateTask, _Mapping]] = ..., finish_task: _Optional[_Union[FinishTask, _Mapping]] = ..., acquire_client: _Optional[_Union[AcquireClient, _Mapping]] = ..., release_client: _Optional[_Union[ReleaseClient, _Mapping]] = ..., garbage_collect_iteration: _Optional[_Union[GarbageCollectIteration, _Mapping]] = ..., remove_worker: _Optional[_Union[RemoveWorker, _Mapping]] = ..., requeue_split: _Optional[_Union[RequeueSplit, _Mapping]] = ..., snapshot: _Optional[_Union[StateSnapshot, _Mapping]] = ..., record_delivered: _Optional[_Union[RecordDelivered, _Mapping]] = ..., split_produced: _Optional[_Union[SplitProduced, _Mapping]] = ..., remove_round_tasks: _Optional[_Union[RemoveRoundTasks, _Mapping]] = ..., remove_dataset: _Optional[_Union[RemoveDataset, _Mapping]] = ..., skip_ids: _Optional[_Union[SkipIds, _Mapping]] = ..., batch: _Optional[_Union[UpdateBatch, _Mapping]] = ...) -> None: ...

class UpdateBatch(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[Update]
    def __init__(self, updates: _Optional[_Iterable[_Union[Update, _Mapping]]] = ...) -> None: ...

class SkipIds(_message.Message):
    __slots__ = ("count",)
    COUNT_FIELD_NUMBER: _ClassVar[int]
    count: int
    def __init__(self, count: _Optional[int] = ...) -> None: ...

class RegisterDataset(_message.Message):
    __slots__ = ("dataset_id", "dataset")
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    dataset_id: str
    dataset: _common_pb2.DatasetDef
    def __init__(self, dataset_id: _Optional[str] = ..., dataset: _Optional[_Union[_common_pb2.DatasetDef, _Mapping]] = ...) -> None: ...

class RegisterWorker(_message.Message):
    __slots__ = ("worker_address", "worker_uid", "worker_index", "host_id", "process_id", "data_port", "data_socket")
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_UID_FIELD_NUMBER: _ClassVar[int]
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_SOCKET_FIELD_NUMBER: _ClassVar[int]
    worker_address: str
    worker_uid: int
    worker_index: int
    host_id: str
    process_id: str
    data_port: int
    data_socket: str
    def __init__(self, worker_address: _Optional[str] = ..., worker_uid: _Optional[int] = ..., worker_index: _Optional[int] = ..., host_id: _Optional[str] = ..., process_id: _Optional[str] = ..., data_port: _Optional[int] = ..., data_socket: _Optional[str] = ...) -> None: ...

class CreateJob(_message.Message):
    __slots__ = ("job_id", "config")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    config: _common_pb2.JobConfig
    def __init__(self, job_id: _Optional[int] = ..., config: _Optional[_Union[_common_pb2.JobConfig, _Mapping]] = ...) -> None: ...

class CreateIteration(_message.Message):
    __slots__ = ("iteration_id", "job_id", "repetition")
    ITERATION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REPETITION_FIELD_NUMBER: _ClassVar[int]
    iteration_id: int
    job_id: int
    repetition: int
    def __init__(self, iteration_id: _Optional[int] = ..., job_id: _Optional[int] = ..., repetition: _Optional[int] = ...) -> None: ...

class ProduceSplit(_message.Message):
    __slots__ = ("iteration_id", "repetition", "split_index", "task_id", "requeued", "replica", "request_id", "ahead")
    ITERATION_ID_FIELD_NUMBER: _ClassVar[int]
    REPETITION_FIELD_NUMBER: _ClassVar[int]
    SPLIT_INDEX_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEUED_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AHEAD_FIELD_NUMBER: _ClassVar[int]
    iteration_id: int
    repetition: int
    split_index: int
    task_id: int
    requeued: bool
    replica: int
    request_id: int
    ahead: bool
    def __init__(self, iteration_id: _Optional[int] = ..., repetition: _Optional[int] = ..., split_index: _Optional[int] = ..., task_id: _Optional[int] = ..., requeued: _Optional[bool] = ..., replica: _Optional[int] = ..., request_id: _Optional[int] = ..., ahead: _Optional[bool] = ...) -> None: ...

class CreateTask(_message.Message):
    __slots__ = ("task_id", "iteration_id", "worker_address", "starting_round")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STARTING_ROUND_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    iteration_id: int
    worker_address: str
    starting_round: int
    def __init__(self, task_id: _Optional[int] = ..., iteration_id: _Optional[int] = ..., worker_address: _Optional[str] = ..., starting_round: _Optional[int] = ...) -> None: ...

class FinishTask(_message.Message):
    __slots__ = ("task_id",)
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    def __init__(self, task_id: _Optional[int] = ...) -> None: ...

class AcquireClient(_message.Message):
    __slots__ = ("client_id", "iteration_id")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    iteration_id: int
    def __init__(self, client_id: _Optional[int] = ..., iteration_id: _Optional[int] = ...) -> None: ...

class ReleaseClient(_message.Message):
    __slots__ = ("client_id",)
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: int
    def __init__(self, client_id: _Optional[int] = ...) -> None: ...

class GarbageCollectIteration(_message.Message):
    __slots__ = ("iteration_id",)
    ITERATION_ID_FIELD_NUMBER: _ClassVar[int]
    iteration_id: int
    def __init__(self, iteration_id: _Optional[int] = ...) -> None: ...

class RemoveWorker(_message.Message):
    __slots__ = ("worker_address",)
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_address: str
    def __init__(self, worker_address: _Optional[str] = ...) -> None: ...

class RequeueSplit(_message.Message):
    __slots__ = ("iteration_id", "split", "delivered_offsets")
    ITERATION_ID_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    DELIVERED_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    iteration_id: int
    split: _common_pb2.SplitKey
    delivered_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, iteration_id: _Optional[int] = ..., split: _Optional[_Union[_common_pb2.SplitKey, _Mapping]] = ..., delivered_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class StateSnapshot(_message.Message):
    __slots__ = ("state",)
    STATE_FIELD_NUMBER: _ClassVar[int]
    state: bytes
    def __init__(self, state: _Optional[bytes] = ...) -> None: ...

class RecordDelivered(_message.Message):
    __slots__ = ("iteration_id", "splits")
    ITERATION_ID_FIELD_NUMBER: _ClassVar[int]
    SPLITS_FIELD_NUMBER: _ClassVar[int]
    iteration_id: int
    splits: _containers.RepeatedCompositeFieldContainer[ReceivedSplit]
    def __init__(self, iteration_id: _Optional[int] = ..., splits: _Optional[_Iterable[_Union[ReceivedSplit, _Mapping]]] = ...) -> None: ...

class RemoveDataset(_message.Message):
    __slots__ = ("dataset_id",)
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    dataset_id: str
    def __init__(self, dataset_id: _Optional[str] = ...) -> None: ...

class RemoveRoundTasks(_message.Message):
    __slots__ = ("iteration_id", "removal")
    ITERATION_ID_FIELD_NUMBER: _ClassVar[int]
    REMOVAL_FIELD_NUMBER: _ClassVar[int]
    iteration_id: int
    removal: _common_pb2.RemovedTasks
    def __init__(self, iteration_id: _Optional[int] = ..., removal: _Optional[_Union[_common_pb2.RemovedTasks, _Mapping]] = ...) -> None: ...

class SplitProduced(_message.Message):
    __slots__ = ("iteration_id", "task_id", "split", "num_elements")
    ITERATION_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    NUM_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    iteration_id: int
    task_id: int
    split: _common_pb2.SplitKey
    num_elements: int
    def __init__(self, iteration_id: _Optional[int] = ..., task_id: _Optional[int] = ..., split: _Optional[_Union[_common_pb2.SplitKey, _Mapping]] = ..., num_elements: _Optional[int] = ...) -> None: ...

from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DatasetDef(_message.Message):
    __slots__ = ("pipeline", "compression", "splittable", "num_splits", "file_based", "num_files", "has_shard_hint", "fingerprint", "order_sensitive", "depends_on", "shared_object", "ephemeral")
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    SPLITTABLE_FIELD_NUMBER: _ClassVar[int]
    NUM_SPLITS_FIELD_NUMBER: _ClassVar[int]
    FILE_BASED_FIELD_NUMBER: _ClassVar[int]
    NUM_FILES_FIELD_NUMBER: _ClassVar[int]
    HAS_SHARD_HINT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ORDER_SENSITIVE_FIELD_NUMBER: _ClassVar[int]
    DEPENDS_ON_FIELD_NUMBER: _ClassVar[int]
    SHARED_OBJECT_FIELD_NUMBER: _ClassVar[int]
    EPHEMERAL_FIELD_NUMBER: _ClassVar[int]
    pipeline: bytes
    compression: str
    splittable: bool
    num_splits: int
    file_based: bool
    num_files: int
    has_shard_hint: bool
    fingerprint: str
    order_sensitive: bool
    depends_on: _containers.RepeatedScalarFieldContainer[str]
    shared_object: bool
    ephemeral: bool
    def __init__(self, pipeline: _Optional[bytes] = ..., compression: _Optional[str] = ..., splittable: _Optional[bool] = ..., num_splits: _Optional[int] = ..., file_based: _Optional[bool] = ..., num_files: _Optional[int] = ..., has_shard_hint: _Optional[bool] = ..., fingerprint: _Optional[str] = ..., order_sensitive: _Optional[bool] = ..., depends_on: _Optional[_Iterable[str]] = ..., shared_object: _Optional[bool] = ..., ephemeral: _Optional[bool] = ...) -> None: ...

class BuildInfo(_message.Message):
    __slots__ = ("package_version", "protocol_version", "python_version")
    PACKAGE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PYTHON_VERSION_FIELD_NUMBER: _ClassVar[int]
    package_version: str
    protocol_version: int
    python_version: str
    def __init__(self, package_version: _Optional[str] = ..., protocol_version: _Optional[int] = ..., python_version: _Optional[str] = ...) -> None: ...

class JobConfig(_message.Message):
    __slots__ = ("dataset_id", "job_name", "sharding_policy", "num_consumers", "target_workers", "cross_trainer_cache", "resume")
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_NAME_FIELD_NUMBER: _ClassVar[int]
    SHARDING_POLICY_FIELD_NUMBER: _ClassVar[int]
    NUM_CONSUMERS_FIELD_NUMBER: _ClassVar[int]
    TARGET_WORKERS_FIELD_NUMBER: _ClassVar[int]
    CROSS_TRAINER_CACHE_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    dataset_id: str
    job_name: str
    sharding_policy: int
    num_consumers: int
    target_workers: str
    cross_trainer_cache: bool
    resume: ConsumedSplits
    def __init__(self, dataset_id: _Optional[str] = ..., job_name: _Optional[str] = ..., sharding_policy: _Optional[int] = ..., num_consumers: _Optional[int] = ..., target_workers: _Optional[str] = ..., cross_trainer_cache: _Optional[bool] = ..., resume: _Optional[_Union[ConsumedSplits, _Mapping]] = ...) -> None: ...

class ConsumedSplits(_message.Message):
    __slots__ = ("repetitions",)
    REPETITIONS_FIELD_NUMBER: _ClassVar[int]
    repetitions: _containers.RepeatedCompositeFieldContainer[ConsumedRepetition]
    def __init__(self, repetitions: _Optional[_Iterable[_Union[ConsumedRepetition, _Mapping]]] = ...) -> None: ...

class ConsumedRepetition(_message.Message):
    __slots__ = ("repetition", "complete", "partial")
    REPETITION_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    repetition: int
    complete: _containers.RepeatedCompositeFieldContainer[SplitRange]
    partial: _containers.RepeatedCompositeFieldContainer[PartialSplit]
    def __init__(self, repetition: _Optional[int] = ..., complete: _Optional[_Iterable[_Union[SplitRange, _Mapping]]] = ..., partial: _Optional[_Iterable[_Union[PartialSplit, _Mapping]]] = ...) -> None: ...

class SplitRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class PartialSplit(_message.Message):
    __slots__ = ("index", "below", "extra")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    BELOW_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    index: int
    below: int
    extra: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[int] = ..., below: _Optional[int] = ..., extra: _Optional[_Iterable[int]] = ...) -> None: ...

class TaskDef(_message.Message):
    __slots__ = ("task_id", "iteration_id", "job_id", "dataset_id", "sharding_policy", "num_workers", "worker_index", "num_consumers", "cross_trainer_cache", "compression", "num_splits")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    SHARDING_POLICY_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_CONSUMERS_FIELD_NUMBER: _ClassVar[int]
    CROSS_TRAINER_CACHE_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    NUM_SPLITS_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    iteration_id: int
    job_id: int
    dataset_id: str
    sharding_policy: int
    num_workers: int
    worker_index: int
    num_consumers: int
    cross_trainer_cache: bool
    compression: str
    num_splits: int
    def __init__(self, task_id: _Optional[int] = ..., iteration_id: _Optional[int] = ..., job_id: _Optional[int] = ..., dataset_id: _Optional[str] = ..., sharding_policy: _Optional[int] = ..., num_workers: _Optional[int] = ..., worker_index: _Optional[int] = ..., num_consumers: _Optional[int] = ..., cross_trainer_cache: _Optional[bool] = ..., compression: _Optional[str] = ..., num_splits: _Optional[int] = ...) -> None: ...

class TaskInfo(_message.Message):
    __slots__ = ("task_id", "worker_address", "worker_uid", "worker_index", "starting_round", "host_id", "process_id", "data_port", "data_socket", "lost")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_UID_FIELD_NUMBER: _ClassVar[int]
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    STARTING_ROUND_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESS_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_SOCKET_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    worker_address: str
    worker_uid: int
    worker_index: int
    starting_round: int
    host_id: str
    process_id: str
    data_port: int
    data_socket: str
    lost: bool
    def __init__(self, task_id: _Optional[int] = ..., worker_address: _Optional[str] = ..., worker_uid: _Optional[int] = ..., worker_index: _Optional[int] = ..., starting_round: _Optional[int] = ..., host_id: _Optional[str] = ..., process_id: _Optional[str] = ..., data_port: _Optional[int] = ..., data_socket: _Optional[str] = ..., lost: _Optional[bool] = ...) -> None: ...

class RemovedTasks(_message.Message):
    __slots__ = ("round", "task_ids")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    round: int
    task_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, round: _Optional[int] = ..., task_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class RemoteError(_message.Message):
    __slots__ = ("type", "message", "traceback")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    type: str
    message: str
    traceback: str
    def __init__(self, type: _Optional[str] = ..., message: _Optional[str] = ..., traceback: _Optional[str] = ...) -> None: ...

class SplitKey(_message.Message):
    __slots__ = ("repetition", "index")
    REPETITION_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    repetition: int
    index: int
    def __init__(self, repetition: _Optional[int] = ..., index: _Optional[int] = ...) -> None: ...

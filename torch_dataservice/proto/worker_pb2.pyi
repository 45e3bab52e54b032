from torch_dataservice.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetElementsRequest(_message.Message):
    __slots__ = ("task_id", "client_id", "max_elements", "max_bytes", "consumer_index", "round_index", "trainer_id")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_INDEX_FIELD_NUMBER: _ClassVar[int]
    ROUND_INDEX_FIELD_NUMBER: _ClassVar[int]
    TRAINER_ID_FIELD_NUMBER: _ClassVar[int]
    task_id: int
    client_id: int
    max_elements: int
    max_bytes: int
    consumer_index: int
    round_index: int
    trainer_id: str
    def __init__(self, task_id: _Optional[int] = ..., client_id: _Optional[int] = ..., max_elements: _Optional[int] = ..., max_bytes: _Optional[int] = ..., consumer_index: _Optional[int] = ..., round_index: _Optional[int] = ..., trainer_id: _Optional[str] = ...) -> None: ...

class ElementInfo(_message.Message):
    __slots__ = ("size", "split", "offset", "has_split")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    HAS_SPLIT_FIELD_NUMBER: _ClassVar[int]
    size: int
    split: _common_pb2.SplitKey
    offset: int
    has_split: bool
    def __init__(self, size: _Optional[int] = ..., split: _Optional[_Union[_common_pb2.SplitKey, _Mapping]] = ..., offset: _Optional[int] = ..., has_split: _Optional[bool] = ...) -> None: ...

class ElementBatchHeader(_message.Message):
    __slots__ = ("elements", "end_of_sequence", "error", "has_error", "dropped_at_end")
    ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    END_OF_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    HAS_ERROR_FIELD_NUMBER: _ClassVar[int]
    DROPPED_AT_END_FIELD_NUMBER: _ClassVar[int]
    elements: _containers.RepeatedCompositeFieldContainer[ElementInfo]
    end_of_sequence: bool
    error: _common_pb2.RemoteError
    has_error: bool
    dropped_at_end: int
    def __init__(self, elements: _Optional[_Iterable[_Union[ElementInfo, _Mapping]]] = ..., end_of_sequence: _Optional[bool] = ..., error: _Optional[_Union[_common_pb2.RemoteError, _Mapping]] = ..., has_error: _Optional[bool] = ..., dropped_at_end: _Optional[int] = ...) -> None: ...

class ProcessTaskRequest(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: _common_pb2.TaskDef
    def __init__(self, task: _Optional[_Union[_common_pb2.TaskDef, _Mapping]] = ...) -> None: ...

class ProcessTaskResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

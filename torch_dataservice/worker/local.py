"""Executor-thread plumbing of a worker with `num_processes=0`: `LocalChannel` hands elements
from pipeline threads to the front as objects (wire/inprocess.py's `LocalElement`), and
`encode_elements` encodes them when a reader elsewhere needs bytes."""

from __future__ import annotations

import itertools
import threading
from typing import Any

from torch_dataservice.errors import describe_exception
from torch_dataservice.wire.inprocess import LocalElement
from torch_dataservice.worker.messages import TaskError


def encode_elements(elements: list[Any]) -> TaskError | None:
    """Give every element (with a `payload`) of `elements` an encoded payload, in order.

    An element that cannot be encoded (not picklable) is an error of the pipeline, as in an
    executor process: it and the elements after it are dropped and the error returned (the
    caller fails the task with it, so every reader of the task learns of it).
    """
    for index, element in enumerate(elements):
        if type(element.payload) is LocalElement:
            try:
                element.payload = element.payload.encoded()
            except Exception as error:
                del elements[index:]
                return TaskError(*describe_exception(error))
    return None


class LocalChannel:
    """Hands `LocalElement`s from an executor thread to the front by token: the executor's
    messages (which keep their order) carry the token, the object itself never is pickled."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens = itertools.count()
        self._objects: dict[int, LocalElement] = {}

    def put(self, element: LocalElement) -> int:
        with self._lock:
            token = next(self._tokens)
            self._objects[token] = element
        return token

    def pop(self, token: int) -> LocalElement:
        with self._lock:
            return self._objects.pop(token)

    def clear(self) -> None:
        with self._lock:
            self._objects.clear()

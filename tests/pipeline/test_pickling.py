"""A pickling error names the path and type of the first part that cannot be pickled."""

from __future__ import annotations

import functools
import pickle
import threading
import types
from typing import Any

import cloudpickle
import pytest

from torch_dataservice.pipeline.pickling import dumps

LOCK = threading.Lock()


class Holder:
    def __init__(self, **attributes: Any) -> None:
        self.__dict__.update(attributes)

    def method(self) -> None:
        pass


class Slotted:
    __slots__ = ("fine", "lock")

    def __init__(self) -> None:
        self.fine, self.lock = 1, threading.Lock()


class Refuses:
    def __reduce__(self) -> Any:
        raise pickle.PicklingError("not this one")


class OddError(Exception):
    def __init__(self, code: int, detail: str) -> None:
        super().__init__(code, detail)


class RaisesOdd:
    def __reduce__(self) -> Any:
        raise OddError(3, "odd")


def uses_global_lock() -> None:
    with LOCK:
        pass


# As a function of the training script: no importable module, so pickled by value.
BY_VALUE = types.FunctionType(uses_global_lock.__code__, {"LOCK": LOCK}, "uses_global_lock")


def closure() -> Any:
    lock = threading.Lock()
    return lambda: lock


@pytest.mark.parametrize("obj,name,path", [
    (Holder(ok=[1], reader=Holder(_pool=Holder(lock=threading.Lock()))), "dataset",
     "dataset.reader._pool.lock (_thread.lock)"),
    ({"dataset": [0, {"k": threading.Lock()}]}, "", "dataset[1]['k'] (_thread.lock)"),
    (Holder(lock=threading.Lock()).method, "worker_init_fn",
     "worker_init_fn.__self__.lock (_thread.lock)"),
    (functools.partial(print, 1, sep=threading.Lock()), "collate_fn",
     "collate_fn.keywords['sep'] (_thread.lock)"),
    (closure(), "collate_fn", "collate_fn.lock (_thread.lock)"),
    (BY_VALUE, "fn", "fn.__globals__['LOCK'] (_thread.lock)"),
    (Holder(inner=Slotted()), "dataset", "dataset.inner.lock (_thread.lock)"),
    (Holder(inner=Refuses()), "x", "x.inner (tests.pipeline.test_pickling.Refuses)"),
])
def test_the_first_unpicklable_part_is_named(obj: Any, name: str, path: str) -> None:
    with pytest.raises(Exception) as info:
        cloudpickle.dumps(obj)
    original = type(info.value)
    with pytest.raises(original) as info:
        dumps(obj, name)
    assert path in str(info.value)
    assert type(info.value.__cause__) is original  # cloudpickle's error, chained


def test_an_error_type_with_other_arguments_becomes_a_pickling_error() -> None:
    with pytest.raises(pickle.PicklingError, match=r"x\.odd \(.*RaisesOdd\)") as info:
        dumps(Holder(odd=RaisesOdd()), "x")
    assert isinstance(info.value.__cause__, OddError)


def test_what_pickles_is_cloudpickles_bytes() -> None:
    value = {"a": [1, 2], "b": Holder(c=3)}
    assert pickle.loads(dumps(value))["b"].c == 3

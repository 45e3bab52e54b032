"""Objects that several datasets share: registered once, unpickled once per executor process.

A DataLoader's map-style dataset and collate_fn stay the same from epoch to epoch while the
epoch's index batches change. The loader registers them once, as a dataset of their own
(`DatasetDef.shared_object`), and each epoch's pipeline holds a `SharedObjectRef` to it. Pickling
a pipeline records the references it holds (`DatasetDef.depends_on`); a worker sends those
datasets to an executor before the pipeline, and when the executor unpickles the pipeline each
reference becomes that executor's one copy of the object, unpickled at its first use and kept
until no task of the worker needs it (so the replicas of one process share it, as threads).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

_local = threading.local()


class SharedObjectRef:
    """Stands for the shared object registered as dataset `dataset_id` (see the module doc)."""

    def __init__(self, dataset_id: str) -> None:
        self.dataset_id = dataset_id

    def __reduce__(self) -> tuple[Callable[[str], Any], tuple[str]]:
        collected = getattr(_local, "collected", None)
        if collected is not None:
            collected.append(self.dataset_id)
        return _resolve, (self.dataset_id,)

    def __repr__(self) -> str:
        return f"SharedObjectRef({self.dataset_id!r})"


def _resolve(dataset_id: str) -> Any:
    resolve = getattr(_local, "resolve", None)
    if resolve is None:  # unpickled outside an executor: stays a reference
        return SharedObjectRef(dataset_id)
    return resolve(dataset_id)


@contextlib.contextmanager
def collecting() -> Iterator[list[str]]:
    """The ids of the references pickled on this thread inside the block, in order."""
    previous = getattr(_local, "collected", None)
    _local.collected = collected = []
    try:
        yield collected
    finally:
        _local.collected = previous


@contextlib.contextmanager
def resolving(resolve: Callable[[str], Any]) -> Iterator[None]:
    """References unpickled on this thread inside the block become `resolve(dataset_id)`."""
    previous = getattr(_local, "resolve", None)
    _local.resolve = resolve
    try:
        yield
    finally:
        _local.resolve = previous

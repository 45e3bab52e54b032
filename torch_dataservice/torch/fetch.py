"""What a worker runs for one index batch of a map-style dataset.

The callable travels inside the registered pipeline (cloudpickled, so a dataset or collate_fn
defined in the training script's `__main__` goes by value) and runs in the worker's executor
processes. Fetching is torch's own `_MapDatasetFetcher`, so `__getitems__`, auto-collation and
`batch_size=None` (no batching: `collate_fn(dataset[i])`) behave exactly as in torch's workers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data._utils.fetch import _MapDatasetFetcher

from torch_dataservice.pipeline.shared_objects import SharedObjectRef


class FetchBatch:
    """`(position, index_batch) -> (position, collate_fn([dataset[i] for i in index_batch]))`."""

    def __init__(self, dataset: Any, auto_collation: bool,
                 collate_fn: Callable[[Any], Any]) -> None:
        self.dataset = dataset
        self.auto_collation = auto_collation
        self.collate_fn = collate_fn

    def __getstate__(self) -> dict:
        return {"dataset": self.dataset, "auto_collation": self.auto_collation,
                "collate_fn": self.collate_fn}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __call__(self, item: tuple[int, Any]) -> tuple[int, Any]:
        fetcher = self.__dict__.get("_fetcher")
        if fetcher is None:
            fetcher = self._fetcher = _MapDatasetFetcher(
                self.dataset, self.auto_collation, self.collate_fn, False)
        position, index = item
        return position, fetcher.fetch(index)


class SharedFetchBatch:
    """A `FetchBatch` registered once as a shared object, called through its reference.

    An epoch's pipeline holds this instead of the FetchBatch itself, so the dataset travels and
    is unpickled once per executor process, not once per epoch (pipeline/shared_objects.py).
    """

    def __init__(self, fetch: SharedObjectRef) -> None:
        self.fetch = fetch

    def __call__(self, item: tuple[int, Any]) -> tuple[int, Any]:
        fetch = self.fetch
        if isinstance(fetch, SharedObjectRef):
            raise RuntimeError(f"{fetch!r} is only resolved in a worker's executor")
        return fetch(item)

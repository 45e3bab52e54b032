"""Torch fidelity: an exception in dataset or collate code reaches the user as its own type,
as with torch.utils.data.DataLoader (the reference is computed by torch's loader in each test),
and what cannot be pickled is named, attribute by attribute, at iter()."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

import torch_dataservice as tds
from tests.conftest import Cluster, free_port
from tests.torch.reference import torch_result

pytestmark = pytest.mark.integration


class CorruptSample(Exception):
    """A user's exception class (shipped by value; found on the trainer by its name)."""


class Samples(torch.utils.data.Dataset):
    def __init__(self, n: int, bad: int, error: type[Exception]) -> None:
        self.n, self.bad, self.error = n, bad, error

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == self.bad:
            raise self.error(f"sample {index} is corrupt")
        return index


def _caught_type(loader: torch.utils.data.DataLoader, error: type[Exception]) -> type:
    try:
        list(loader)
    except error as caught:
        return error if isinstance(caught, error) else type(caught)
    raise AssertionError("no error raised")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("error", [KeyError, ValueError, CorruptSample])
def test_getitem_errors_are_caught_by_their_type_as_with_torch(
        cluster: Cluster, error: type[Exception]) -> None:
    dataset = Samples(8, 5, error)
    expected = _caught_type(torch.utils.data.DataLoader(dataset, batch_size=2), error)
    got = _caught_type(tds.DataLoader(dataset, batch_size=2, service=cluster.target), error)
    assert got is expected is error
    with pytest.raises(error) as info:
        list(tds.DataLoader(dataset, batch_size=2, service=cluster.target))
    assert isinstance(info.value, tds.RemoteError)
    assert "sample 5 is corrupt" in str(info.value)
    assert "__getitem__" in info.value.remote_traceback  # where it failed, on the worker


@pytest.mark.timeout(60)
def test_collate_errors_are_caught_by_their_type_as_with_torch(cluster: Cluster) -> None:
    def collate(batch: list[int]) -> list[int]:
        if 3 in batch:
            raise ValueError("cannot collate sample 3")
        return batch

    dataset = Samples(6, -1, KeyError)
    with pytest.raises(ValueError, match="cannot collate sample 3"):
        list(torch.utils.data.DataLoader(dataset, batch_size=2, collate_fn=collate))
    with pytest.raises(ValueError, match="cannot collate sample 3") as info:
        list(tds.DataLoader(dataset, batch_size=2, collate_fn=collate, service=cluster.target))
    assert isinstance(info.value, tds.RemoteError)


class Pool:
    def __init__(self) -> None:
        self.size = 4
        self.lock = threading.Lock()


class Reader:
    def __init__(self) -> None:
        self.path = "data.bin"
        self._pool = Pool()

    def configure(self, worker_id: int) -> None:
        self.worker = worker_id


class Holding(torch.utils.data.Dataset):
    """A dataset that cannot be pickled: a lock, three attributes deep."""

    def __init__(self) -> None:
        self.items = list(range(4))
        self.reader = Reader()

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return index


class HoldingStream(torch.utils.data.IterableDataset):
    def __init__(self) -> None:
        self.reader = Reader()

    def __iter__(self):
        return iter(range(4))


def lock_in_closure() -> Any:
    lock = threading.Lock()

    def collate(batch: list[int]) -> list[int]:
        with lock:
            return batch

    return collate


UNPICKLABLE_IN_TORCH = """
    import json, torch
    from tests.torch.test_fidelity_errors import Holding
    loader = torch.utils.data.DataLoader(Holding(), batch_size=2, num_workers=1,
                                         multiprocessing_context="spawn")
    try:
        iter(loader)
    except Exception as error:
        print(json.dumps(type(error).__name__))
"""


@pytest.fixture(scope="module")
def torchs_error() -> str:
    """The type of error torch's spawned workers fail with at iter()."""
    return torch_result(UNPICKLABLE_IN_TORCH)


@pytest.mark.integration
@pytest.mark.parametrize("make,path", [
    (lambda: dict(dataset=Holding()), "dataset.reader._pool.lock (_thread.lock)"),
    (lambda: dict(dataset=HoldingStream()), "dataset.reader._pool.lock (_thread.lock)"),
    (lambda: dict(dataset=list(range(4)), collate_fn=lock_in_closure()),
     "collate_fn.lock (_thread.lock)"),
    (lambda: dict(dataset=list(range(4)), num_workers=1,
                  worker_init_fn=Reader().configure),
     "worker_init_fn.__self__._pool.lock (_thread.lock)"),
], ids=["dataset", "iterable", "collate_fn", "worker_init_fn"])
def test_an_unpicklable_attribute_is_named_at_iter_before_any_contact(
        make: Any, path: str, torchs_error: str) -> None:
    assert torchs_error == "TypeError"  # ours is of the same type
    kwargs = make()
    loader = tds.DataLoader(kwargs.pop("dataset"), batch_size=2, **kwargs,
                            service=f"grpc://127.0.0.1:{free_port()}")  # nobody listens
    started = time.monotonic()
    with pytest.raises(TypeError) as info:
        iter(loader)
    assert time.monotonic() - started < 5  # no attempt to reach the service
    assert path in str(info.value)
    assert isinstance(info.value.__cause__, TypeError)
    assert "cannot pickle '_thread.lock' object" in str(info.value.__cause__)

"""Torch fidelity: an exception in dataset or collate code reaches the user as its own type,
as with torch.utils.data.DataLoader (the reference is computed by torch's loader in each test)."""

from __future__ import annotations

import pytest
import torch

import torch_dataservice as tds
from tests.conftest import Cluster

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

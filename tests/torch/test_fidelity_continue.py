"""Torch fidelity, errors and timeouts: after a batch raises, the next next() goes on with the
following batch, and `timeout=` raises torch's error (and waits again on the next call), as
torch.utils.data.DataLoader does (each test computes torch's own outcome as the reference)."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import torch_dataservice as tds
from tests.conftest import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


class Flaky(Dataset):
    def __init__(self, n: int, bad: set[int]) -> None:
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index in self.bad:
            raise KeyError(f"sample {index} is corrupt")
        return index


class FlakyIterator:
    """An iterator that raises on some elements and then goes on (not a generator)."""

    def __init__(self, n: int, bad: set[int]) -> None:
        self.i, self.n, self.bad = 0, n, bad

    def __iter__(self) -> FlakyIterator:
        return self

    def __next__(self) -> int:
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        if self.i - 1 in self.bad:
            raise ValueError(f"element {self.i - 1} is corrupt")
        return self.i - 1


class FlakyStream(IterableDataset):
    def __init__(self, n: int, bad: set[int], generator: bool) -> None:
        self.n, self.bad, self.generator = n, bad, generator

    def __iter__(self) -> Iterator[int]:
        if not self.generator:
            return FlakyIterator(self.n, self.bad)
        return self._generate()

    def _generate(self) -> Iterator[int]:
        for i in range(self.n):
            if i in self.bad:
                raise ValueError(f"element {i} is corrupt")  # a generator ends here
            yield i


def outcomes(loader: Any, limit: int = 50) -> list[Any]:
    """What each next() gives: a batch as a list, or the type of the exception it raised."""
    got: list[Any] = []
    iterator = iter(loader)
    for _ in range(limit):
        try:
            batch = next(iterator)
        except StopIteration:
            return got
        except Exception as error:  # noqa: BLE001 - the type is what is compared
            got.append(next(t.__name__ for t in type(error).__mro__
                            if t.__module__ == "builtins"))
            continue
        got.append(batch.tolist() if isinstance(batch, torch.Tensor) else batch)
    raise AssertionError(f"more than {limit} batches: {got}")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_after_a_getitem_error_the_epoch_goes_on_as_with_torch(cluster: Cluster,
                                                               num_workers: int) -> None:
    kwargs = dict(batch_size=2, num_workers=num_workers)
    expected = outcomes(torch.utils.data.DataLoader(Flaky(9, {3, 4}), **kwargs))
    assert "KeyError" in expected and expected[-1] == [8]
    assert outcomes(tds.DataLoader(Flaky(9, {3, 4}), service=cluster.target, **kwargs)) \
        == expected


def test_after_a_collate_error_the_epoch_goes_on_as_with_torch(cluster: Cluster) -> None:
    def collate(batch: list[int]) -> list[int]:
        if 2 in batch:
            raise ValueError("cannot collate sample 2")
        return batch

    kwargs = dict(batch_size=2, collate_fn=collate)
    expected = outcomes(torch.utils.data.DataLoader(Flaky(7, set()), **kwargs))
    assert expected == [[0, 1], "ValueError", [4, 5], [6]]
    assert outcomes(tds.DataLoader(Flaky(7, set()), service=cluster.target, **kwargs)) \
        == expected


@pytest.mark.parametrize("generator", [False, True], ids=["iterator", "generator"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_iterable_errors_go_on_or_end_as_with_torch(cluster: Cluster, num_workers: int,
                                                     generator: bool) -> None:
    kwargs = dict(batch_size=None, num_workers=num_workers)
    expected = outcomes(torch.utils.data.DataLoader(FlakyStream(6, {2}, generator), **kwargs))
    assert "ValueError" in expected
    ours = outcomes(tds.DataLoader(FlakyStream(6, {2}, generator), service=cluster.target,
                                   **kwargs))
    assert ours == expected


class Gated(Dataset):
    """torch's SleepDataset, made certain: the first sample waits for a file that the test
    makes once the loader has timed out. (A 2 s sleep raced on a loaded machine: when the
    caller ran a second late after the job started, the batch was there before its timeout.)"""

    def __init__(self, gate: str) -> None:
        self.gate = gate

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        if index == 0:
            deadline = time.monotonic() + 60
            while not os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.02)
        return index


def test_timeout_raises_torchs_error_then_waits_again(cluster: Cluster, tmp_path: Path) -> None:
    pattern = r"DataLoader timed out after \d+ seconds"  # what torch's own suite checks
    for loader_type, extra in ((torch.utils.data.DataLoader, {}),
                               (tds.DataLoader, {"service": cluster.target})):
        gate = tmp_path / f"open-{loader_type.__module__}"
        loader = loader_type(Gated(str(gate)), batch_size=2, num_workers=2, timeout=1, **extra)
        iterator = iter(loader)
        try:
            with pytest.raises(RuntimeError) as info:
                next(iterator)
            assert re.search(pattern, str(info.value)), (loader_type, str(info.value))
        finally:
            gate.touch()  # the first sample may finish now
        if loader_type is tds.DataLoader:
            # As torch's does, the iterator waits again on each next call: the batch comes
            # once ready.
            batch = None
            for _ in range(30):
                try:
                    batch = next(iterator)
                    break
                except RuntimeError as error:
                    assert re.search(pattern, str(error)), str(error)
            assert batch is not None and batch.tolist() == [0, 1]

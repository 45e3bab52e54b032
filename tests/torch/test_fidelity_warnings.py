"""Torch fidelity, warnings and collate errors torch gives: too many workers for the machine,
the deprecated pin_memory_device, default_collate's error for nested tensors (each test
computes torch's own message as the reference)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import torch_dataservice as tds
from tests.conftest import Cluster
from torch_dataservice.torch import embedded

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


class Small(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index)])


class Nested(Small):
    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.nested.nested_tensor([torch.ones(index + 1), torch.ones(2)])


def caught(action: Any, needle: str) -> list[str]:
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        action()
    return [str(r.message) for r in records if needle in str(r.message)]


def test_too_many_workers_warns_as_torch_where_the_executors_run_here(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded service's executors share this machine's cores: torch's warning, as
    torch gives it."""
    monkeypatch.delenv(embedded.ADDRESS_ENV, raising=False)
    too_many = len(os.sched_getaffinity(0)) + 3
    try:
        for make in (lambda: list(torch.utils.data.DataLoader(Small(), num_workers=too_many)),
                     lambda: list(tds.DataLoader(Small(), num_workers=too_many))):
            messages = caught(make, "worker processes in total")
            assert len(messages) == 2  # at construction and at iter(), as torch
            assert f"will create {too_many} worker processes" in messages[0]
        expected = caught(lambda: torch.utils.data.DataLoader(Small(), num_workers=too_many),
                          "worker processes in total")
        assert caught(lambda: tds.DataLoader(Small(), num_workers=too_many),
                      "worker processes in total") == expected
    finally:
        embedded.shutdown()


def test_too_many_workers_do_not_warn_with_a_remote_service(cluster: Cluster) -> None:
    """No worker process starts on this machine: nothing to warn about (issue 24.5)."""
    too_many = len(os.sched_getaffinity(0)) + 3
    assert caught(lambda: list(tds.DataLoader(Small(), num_workers=too_many,
                                              service=cluster.target)),
                  "worker processes") == []


def test_deprecated_pin_memory_device_warns_as_torch(cluster: Cluster) -> None:
    kwargs = dict(pin_memory=True, pin_memory_device="cuda")
    expected = caught(lambda: iter(torch.utils.data.DataLoader(Small(), **kwargs)),
                      "pin_memory_device is deprecated")
    assert len(expected) == 1
    assert caught(lambda: list(tds.DataLoader(Small(), service=cluster.target, **kwargs)),
                  "pin_memory_device is deprecated") == expected


def test_nested_tensors_get_default_collates_error(cluster: Cluster) -> None:
    with pytest.raises(RuntimeError) as theirs:
        list(torch.utils.data.DataLoader(Nested(), batch_size=2))
    assert "nested tensors" in str(theirs.value)
    with pytest.raises(RuntimeError) as ours:
        list(tds.DataLoader(Nested(), batch_size=2, service=cluster.target))
    assert str(theirs.value) in str(ours.value)

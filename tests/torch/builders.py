"""Datasets and helpers shared by the tests of tds.DataLoader (importable by torch's worker
processes and by executors, which unpickle these classes by reference)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


class RangeShards(IterableDataset):
    """torch's documented pattern: each worker takes its own slice of [start, end)."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        if info is None:
            return iter(range(self.start, self.end))
        per_worker = int(math.ceil((self.end - self.start) / float(info.num_workers)))
        start = self.start + info.id * per_worker
        return iter(range(start, min(start + per_worker, self.end)))


class Indices(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def epoch(loader: Any, limit: int | None = None) -> list[list[int]]:
    out = []
    for batch in itertools.islice(loader, limit):
        out.append(batch.tolist() if isinstance(batch, torch.Tensor) else batch)
    return out


def as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world_size: int) -> None:
    """torchrun's environment without a process group: ranks need no communication."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test-run")

"""Torch fidelity, worker identity: in dataset code on service workers get_worker_info(),
worker_init_fn, IterableDataset sharding and the len() warning behave as with
torch.utils.data.DataLoader (each test computes torch's own result as the reference)."""

from __future__ import annotations

import math
import uuid
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import torch_dataservice as tds
from tests.conftest import Cluster
from tests.torch.builders import RangeShards

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


class Probe(Dataset):
    """Each sample says which worker made it, and which worker ids were initialised in the
    process before (worker_init_fn appends to `inits` of the process's copy)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tag = uuid.uuid4().hex  # a copy of its own on the workers, whatever ran before
        self.inits: list[int] = []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        info = get_worker_info()
        assert info is not None
        return {"i": index, "id": info.id, "n": info.num_workers, "seed": info.seed,
                "dataset": type(info.dataset).__name__, "inits": list(self.inits)}


def record_init(worker_id: int) -> None:
    info = get_worker_info()
    assert info is not None and info.id == worker_id
    info.dataset.inits.append(worker_id)


def failing_init(worker_id: int) -> None:
    raise KeyError(f"no config for worker {worker_id}")


def identities(loader: Any) -> list[tuple]:
    return [(b["i"], b["id"], b["n"], b["seed"], b["dataset"]) for b in loader]


def test_get_worker_info_is_torchs_for_every_batch(cluster: Cluster) -> None:
    for num_workers in (2, 3):
        kwargs = dict(batch_size=None, shuffle=True, num_workers=num_workers)
        theirs = torch.utils.data.DataLoader(
            Probe(9), generator=torch.Generator().manual_seed(5), **kwargs)
        ours = tds.DataLoader(Probe(9), generator=torch.Generator().manual_seed(5),
                              service=cluster.target, **kwargs)
        # Same ids, worker counts, seeds (base seed drawn from the generator as torch draws
        # it, + id) and dataset, batch by batch, over two epochs.
        for _ in range(2):
            assert identities(ours) == identities(theirs)


def test_without_workers_there_is_no_worker_info_as_with_torch(cluster: Cluster) -> None:
    class Plain(Probe):
        def __getitem__(self, index: int) -> Any:
            return get_worker_info() is None

    expected = list(torch.utils.data.DataLoader(Plain(3), batch_size=None))
    assert list(tds.DataLoader(Plain(3), batch_size=None, service=cluster.target)) == expected


def test_worker_init_fn_runs_before_the_first_sample_of_each_worker(cluster: Cluster) -> None:
    def run(loader_type: type, **extra: Any) -> list[tuple[int, bool, int]]:
        loader = loader_type(Probe(8), batch_size=None, num_workers=2,
                             worker_init_fn=record_init, **extra)
        # (worker id, initialised before this sample, times initialised in this process)
        return [(b["id"], b["id"] in b["inits"], b["inits"].count(b["id"])) for b in loader]

    theirs = run(torch.utils.data.DataLoader)
    ours = run(tds.DataLoader, service=cluster.target)
    assert [worker for worker, _, _ in ours] == [worker for worker, _, _ in theirs]
    assert all(before and once == 1 for _, before, once in theirs + ours)


def test_an_error_in_worker_init_fn_reaches_the_user_as_with_torch(cluster: Cluster) -> None:
    def outcomes(loader: Any) -> list[Any]:
        got: list[Any] = []
        iterator = iter(loader)
        while True:
            try:
                got.append(next(iterator)["i"])
            except StopIteration:
                return got
            except KeyError as error:  # the worker's first batch is the init error
                got.append(("KeyError", "no config for worker" in str(error)))
            except Exception as error:  # noqa: BLE001 - torch's later batches, see below
                got.append(type(error).__name__)

    kwargs = dict(batch_size=None, num_workers=2, worker_init_fn=failing_init)
    # torch 2.13's workers fail every later batch too (UnboundLocalError: no fetcher, a bug
    # of theirs): the first batch of each worker is what both must agree on.
    expected = outcomes(torch.utils.data.DataLoader(Probe(5), **kwargs))[:2]
    assert expected == [("KeyError", True)] * 2
    ours = outcomes(tds.DataLoader(Probe(5), service=cluster.target, **kwargs))
    assert ours == expected + [2, 3, 4]


class Replicated(IterableDataset):
    """Does not shard itself: with torch, every worker yields all of it."""

    def __iter__(self) -> Iterator[int]:
        return iter(range(5))


def slice_in_init(worker_id: int) -> None:
    """torch's documented worker_init_fn pattern: configure the worker's copy of the dataset."""
    info = get_worker_info()
    dataset = info.dataset
    per_worker = int(math.ceil((dataset.end - dataset.start) / float(info.num_workers)))
    dataset.start = dataset.start + worker_id * per_worker
    dataset.end = min(dataset.start + per_worker, dataset.end)


class Unsharded(RangeShards):
    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end))


@pytest.mark.parametrize("make,extra", [
    (lambda: RangeShards(0, 20), {}),
    (lambda: Replicated(), {}),
    (lambda: Unsharded(3, 17), {"worker_init_fn": slice_in_init}),
], ids=["shards-itself", "replica-per-worker", "worker_init_fn-slices"])
def test_iterable_datasets_yield_what_torchs_workers_yield(
        cluster: Cluster, make: Any, extra: dict) -> None:
    for num_workers, batch_size in ((2, 3), (3, 4), (0, 3)):
        kwargs = dict(batch_size=batch_size, num_workers=num_workers, **extra)
        theirs = [b.tolist() for b in torch.utils.data.DataLoader(make(), **kwargs)]
        ours = [b.tolist() for b in tds.DataLoader(make(), service=cluster.target, **kwargs)]
        assert ours == theirs, (num_workers, batch_size)


def test_shards_spread_over_a_fleet_yield_each_element_once(cluster_factory) -> None:
    fleet = cluster_factory(2, num_processes=0)  # two workers, executors on threads
    kwargs = dict(batch_size=2, num_workers=5)
    theirs = [b.tolist() for b in torch.utils.data.DataLoader(RangeShards(0, 40), **kwargs)]
    ours = [b.tolist() for b in tds.DataLoader(RangeShards(0, 40), service=fleet.target,
                                               **kwargs)]
    assert ours == theirs
    assert sorted(i for b in ours for i in b) == list(range(40))


class Overlong(IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(5))

    def __len__(self) -> int:
        return 3


def test_len_exceeded_warning_as_torch_gives_it(cluster: Cluster) -> None:
    def messages(loader: Any) -> list[str]:
        assert len(loader) == 3
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            list(loader)
        return [str(w.message) for w in caught if "Length of IterableDataset" in str(w.message)]

    dataset = Overlong()  # one object: torch's message names it
    for num_workers in (0, 1):
        expected = messages(torch.utils.data.DataLoader(dataset, batch_size=None,
                                                        num_workers=num_workers))
        assert len(expected) == 2
        assert messages(tds.DataLoader(dataset, batch_size=None, num_workers=num_workers,
                                       service=cluster.target)) == expected

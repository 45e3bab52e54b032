"""Torch fidelity, resume details: the state is plain JSON-able data, load_state_dict behaves
as torchdata's StatefulDataLoader (an empty dict changes nothing, a running iterator goes on,
the next iter() resumes, bad states are refused naming the problem), and multi-epoch shuffled
and in_order=False resumes match an uninterrupted run."""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import torch_dataservice as tds
from tests.conftest import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


class Indices(Dataset):
    def __init__(self, n: int = 23, slow_every: int = 0) -> None:
        self.n, self.slow_every = n, slow_every

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if self.slow_every and index % self.slow_every == 0:
            time.sleep(0.05)  # later batches overtake this one on the other worker
        return index


def batches(loader: Any, limit: int | None = None) -> list[list[int]]:
    return [b.tolist() for b in itertools.islice(loader, limit)]


def json_roundtrip(state: dict) -> dict:
    return json.loads(json.dumps(state))


@pytest.mark.parametrize("use_set_epoch", [False, True], ids=["torch-exact", "set_epoch"])
def test_multi_epoch_shuffled_resume_matches_an_uninterrupted_run(
        cluster: Cluster, use_set_epoch: bool) -> None:
    def make() -> tds.DataLoader:
        return tds.DataLoader(Indices(), batch_size=4, shuffle=True, service=cluster.target,
                              generator=torch.Generator().manual_seed(17))

    def epoch(loader: tds.DataLoader, number: int, limit: int | None = None) -> list:
        if use_set_epoch:
            loader.set_epoch(number)
        return batches(loader, limit)

    whole = make()
    uninterrupted = [epoch(whole, e) for e in range(4)]
    assert len({json.dumps(e) for e in uninterrupted}) == 4
    for stop_epoch, stop_batch in ((0, 2), (2, 0), (2, 5), (3, 1)):
        loader = make()
        got = [epoch(loader, e) for e in range(stop_epoch)]
        head = epoch(loader, stop_epoch, limit=stop_batch) if stop_batch else []
        saved = json_roundtrip(loader.state_dict())  # plain data: survives JSON
        restored = make()
        restored.load_state_dict(saved)
        got.append(head + epoch(restored, stop_epoch))
        got += [epoch(restored, e) for e in range(stop_epoch + 1, 4)]
        assert got == uninterrupted, (stop_epoch, stop_batch)


def test_out_of_order_resume_yields_each_remaining_batch_once(cluster_factory) -> None:
    fleet = cluster_factory(2, num_processes=0)

    def make() -> tds.DataLoader:
        return tds.DataLoader(Indices(40, slow_every=4), batch_size=2, shuffle=True,
                              in_order=False, service=fleet.target,
                              generator=torch.Generator().manual_seed(2))

    reference = make()
    uninterrupted = [sorted(batches(reference)) for _ in range(2)]
    loader = make()
    head = batches(loader, limit=7)
    saved = json_roundtrip(loader.state_dict())
    restored = make()
    restored.load_state_dict(saved)
    rest = batches(restored)
    assert len(head) + len(rest) == len(uninterrupted[0])
    assert sorted(head + rest) == uninterrupted[0]  # none lost, none twice
    assert sorted(batches(restored)) == uninterrupted[1]


def test_load_state_dict_at_any_time_as_torchdata(cluster: Cluster) -> None:
    def make() -> tds.DataLoader:
        return tds.DataLoader(Indices(12), batch_size=3, shuffle=True, service=cluster.target,
                              generator=torch.Generator().manual_seed(4))

    expected = batches(make())
    loader = make()
    loader.load_state_dict({})  # torchdata: an empty state changes nothing
    assert batches(loader) == expected

    source = make()
    head = batches(source, limit=1)
    saved = json_roundtrip(source.state_dict())
    loader = make()
    running = iter(loader)
    first = next(running).tolist()
    loader.load_state_dict(saved)  # mid-iteration: the running iterator goes on as it was
    assert [first] + batches(running) == expected
    assert loader.state_dict() == saved  # until the next iter(), the loaded state
    assert head + batches(loader) == expected  # which resumes from it

    for bad, named in (([1, 2], "list"), ({"epoch": 1}, "missing"),
                       ({**saved, "epoch": -1}, "'epoch'")):
        with pytest.raises(ValueError, match=named):
            make().load_state_dict(bad)


def test_iterable_state_survives_json(cluster: Cluster) -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(20))

    def make() -> tds.DataLoader:
        return tds.DataLoader(Stream(), batch_size=3, num_workers=2, service=cluster.target)

    expected = batches(make())
    loader = make()
    head = batches(loader, limit=3)
    restored = make()
    restored.load_state_dict(json_roundtrip(loader.state_dict()))
    assert head + batches(restored) == expected

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
from tests.torch.reference import torch_result

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


UNSEEDED_EPOCHS = """
    import json, torch
    torch.manual_seed({seed})
    loader = torch.utils.data.DataLoader(list(range(16)), batch_size=4, shuffle=True,
                                         num_workers={workers},
                                         persistent_workers={persistent})
    print(json.dumps([[b.tolist() for b in loader] for _ in range({epochs})]))
"""


@pytest.mark.integration
@pytest.mark.parametrize("restart", [False, True], ids=["same-process", "rng-restored"])
@pytest.mark.parametrize("workers", [0, 2])
def test_an_unseeded_shuffle_resumed_between_epochs_goes_on_as_torch(
        cluster: Cluster, restart: bool, workers: int) -> None:
    """The epochs after a restored one go on from torch's global RNG as an uninterrupted
    run's do: neither the restored epoch nor its draws are repeated."""
    want = torch_result(UNSEEDED_EPOCHS.format(seed=0, workers=workers, persistent=False,
                                               epochs=3))

    def make() -> tds.DataLoader:
        return tds.DataLoader(list(range(16)), batch_size=4, shuffle=True,
                              num_workers=workers, service=cluster.target)

    torch.manual_seed(0)
    first = make()
    assert batches(first) == want[0]
    saved, rng = json_roundtrip(first.state_dict()), torch.get_rng_state()
    if restart:  # a new process seeds, then restores the RNG saved with the checkpoint
        torch.manual_seed(123)
        torch.set_rng_state(rng)
    restored = make()
    restored.load_state_dict(saved)
    assert [batches(restored), batches(restored)] == want[1:]


@pytest.mark.integration
def test_a_fresh_state_loaded_into_persistent_workers_that_ran_draws_its_own_seed(
        cluster: Cluster) -> None:
    want = torch_result(UNSEEDED_EPOCHS.format(seed=3, workers=2, persistent=True, epochs=1))

    def make() -> tds.DataLoader:
        return tds.DataLoader(list(range(16)), batch_size=4, shuffle=True, num_workers=2,
                              persistent_workers=True, service=cluster.target)

    torch.manual_seed(3)
    never_iterated = make()
    saved = json_roundtrip(never_iterated.state_dict())
    assert batches(never_iterated) == want[0]
    ran = make()
    next(iter(ran))  # its workers' base seed is drawn
    ran.load_state_dict(saved)
    assert batches(ran) == want[0]

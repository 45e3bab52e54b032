"""The world-size-independent state of map-style loaders, without torchrun: the range encoding,
how an epoch (or its remainder) is dealt out to the ranks, how ranks' views combine, and loaders
at one world size resuming a state saved at another (ranks simulated in one process; the
collective is replaced by a barrier between threads). tests/torch/test_resume_torchrun.py runs
the same with real processes."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler

import torch_dataservice as tds
from tests.conftest import Cluster
from tests.torch.builders import Indices, as_rank, epoch
from torch_dataservice.torch import dataloader as dataloader_module
from torch_dataservice.torch import global_state, ranges, registration, sampling
from torch_dataservice.torch.dealing import DROP, PAD, UNEVEN, Deal, even_policy
from torch_dataservice.torch.distributed import RankInfo
from torch_dataservice.torch.global_state import RankView

pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------------------------- ranges

def test_ranges_set_operations() -> None:
    assert ranges.normalized([(5, 7), (0, 2), (2, 3), (6, 9), (4, 4)]) == [(0, 3), (5, 9)]
    assert ranges.from_positions([3, 0, 1, 2, 7]) == [(0, 4), (7, 8)]
    assert ranges.complement([(0, 3), (5, 9)], 10) == [(3, 5), (9, 10)]
    assert ranges.complement([], 4) == [(0, 4)]
    sequence = [(10, 13), (20, 22)]  # 10 11 12 20 21
    assert ranges.take(sequence, 1, 4) == [(11, 13), (20, 21)]
    assert ranges.repeat_to(sequence, 7) == [(10, 13), (20, 22), (10, 12)]
    assert ranges.expand(ranges.repeat_to([(4, 5)], 3)) == [4, 4, 4]
    assert ranges.size(sequence) == 5


def test_ranges_decode_refuses_bad_data_naming_it() -> None:
    assert ranges.decode(json.loads(json.dumps(ranges.encode([(0, 3), (5, 9)]))), 10) == [
        (0, 3), (5, 9)]
    for bad, named in (("0-3", "list"), ([[0]], r"\[0\]"), ([[0, 11]], r"\[0, 11\)"),
                       ([[3, 3]], r"\[3, 3\)"), ([[0, 3], [2, 5]], "sorted"),
                       ([[0, True]], "True")):
        with pytest.raises(ValueError, match=named):
            ranges.decode(bad, 10)


# ----------------------------------------------------------------------------- dealing

def test_even_policy_names_a_bad_value() -> None:
    assert [even_policy(v) for v in (True, "drop", "pad", False)] == [DROP, DROP, PAD, UNEVEN]
    for bad in ("Pad", 1, None):
        with pytest.raises(ValueError, match=repr(bad)):
            even_policy(bad)


@pytest.mark.parametrize("policy", [DROP, PAD])
def test_a_fresh_epoch_is_dealt_as_distributed_sampler(policy: str) -> None:
    n, world = 23, 5
    order = sampling.seeded_default_order(n, True, 7, 2)
    deal = Deal(n, world, policy)
    for rank in range(world):
        sampler = DistributedSampler(Indices(n), num_replicas=world, rank=rank, seed=7,
                                     drop_last=policy == DROP)
        sampler.set_epoch(2)
        assert [order[p] for p in deal.positions(rank)] == list(sampler)
    assert (deal.dropped, deal.padded) == ((3, 0) if policy == DROP else (0, 2))


@pytest.mark.parametrize("policy", [DROP, PAD, UNEVEN])
@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_a_remainder_is_dealt_disjointly_and_evenly(policy: str, world: int) -> None:
    consumed = ((0, 10), (12, 13), (20, 25))  # 16 of 40 yielded before the save
    deal = Deal(40, world, policy, consumed)
    parts = [deal.positions(rank) for rank in range(world)]
    assert [len(p) for p in parts] == [deal.count(rank) for rank in range(world)]
    got = [p for part in parts for p in part]
    left = ranges.expand(ranges.complement(list(consumed), 40))
    if policy == UNEVEN:
        assert sorted(got) == left and max(map(len, parts)) - min(map(len, parts)) <= 1
        return
    assert len({len(p) for p in parts}) == 1  # every rank as many
    if policy == DROP:
        assert len(got) == len(set(got)) and set(got) <= set(left)
        assert len(left) - len(got) == deal.dropped == 24 % world
    else:
        assert set(got) == set(left) and len(got) - len(left) == deal.padded == -24 % world


# ----------------------------------------------------------------------------- combining

def test_ranks_in_step_make_one_range_whatever_the_epoch_size() -> None:
    n, world, batch = 1_000_000, 4, 32
    deal = Deal(n, world, DROP)
    views = [global_state.running_view(0, set(range(100)), 100, deal.count(r), batch)
             for r in range(world)]
    number, in_progress, consumed, batches = global_state.combine(views, deal)
    assert (number, in_progress, consumed, batches) == (0, True, [(0, 12800)], 100)
    state = global_state.encode(number, in_progress, 1, world, batches, "samples", n, consumed)
    assert len(json.dumps(state)) < 300


def test_views_out_of_step_and_out_of_order_combine_exactly() -> None:
    world, batch = 3, 2
    deal = Deal(22, world, DROP, ((0, 4),))  # a resumed epoch: positions 4..21 dealt
    positions = [deal.positions(r) for r in range(world)]  # rank r: [4+r, 7+r, ...]
    yielded = [{0, 1}, {0, 2}, set()]  # rank 1 got its third batch before its second
    views = [global_state.running_view(5, y, len(y), deal.count(r), batch)
             for r, y in enumerate(yielded)]
    assert views[1].prefix == 2 and views[1].extras == (4, 5)
    _, _, consumed, _ = global_state.combine(views, deal)
    expected = set(range(4))
    for rank, batches in enumerate(yielded):
        expected |= {positions[rank][i] for j in batches for i in range(2 * j, 2 * j + 2)}
    assert ranges.expand(consumed) == sorted(expected)


def test_combine_between_epochs_and_refuses_ranks_at_different_epochs() -> None:
    deal = Deal(10, 2, DROP)
    done = [RankView(3, "done", batches=5), RankView(3, "done", batches=5)]
    assert global_state.combine(done, deal) == (4, False, [], 0)
    assert global_state.combine([RankView(4, "idle"), done[0]], deal)[:2] == (4, False)
    running = global_state.running_view(3, {0}, 1, 5, 1)
    # A rank done with its part, the other still in it: the done one yielded all of its part.
    _, _, consumed, _ = global_state.combine([done[0], running], deal)
    assert ranges.expand(consumed) == sorted({0, 2, 4, 6, 8, 1})
    with pytest.raises(ValueError, match="rank 0 running in epoch 3, rank 1 running in epoch 4"):
        global_state.combine([running, global_state.running_view(4, {0}, 1, 5, 1)], deal)


# ----------------------------------------------------------------------------- loaders

class FakeGroup:
    """All ranks' loaders in one process, on threads: all_gather is a barrier."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=20)
        self.slots: list[Any] = [None] * world
        self.rank = threading.local()

    def all_gather(self, value: Any) -> list[Any]:
        self.slots[self.rank.value] = value
        self.barrier.wait()
        gathered = list(self.slots)
        self.barrier.wait()
        return gathered

    def run(self, each: Callable[[int], Any]) -> list[Any]:
        results: list[Any] = [None] * self.world
        errors: list[BaseException] = []

        def target(rank: int) -> None:
            self.rank.value = rank
            try:
                results[rank] = each(rank)
            except BaseException as error:  # noqa: BLE001 - re-raised below
                errors.append(error)
                self.barrier.abort()

        threads = [threading.Thread(target=target, args=(r,)) for r in range(self.world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(40)
        assert not any(t.is_alive() for t in threads), "a rank hangs"
        if errors:
            raise errors[0]
        return results


def group_loaders(monkeypatch: pytest.MonkeyPatch, world: int,
                  make: Callable[[], tds.DataLoader]) -> tuple[FakeGroup, list[tds.DataLoader]]:
    group = FakeGroup(world)
    monkeypatch.setattr(global_state, "all_gather", group.all_gather)
    loaders = []
    for rank in range(world):
        monkeypatch.setattr(dataloader_module, "rank_info",
                            lambda rank=rank: RankInfo(rank, world, True))
        loaders.append(make())
    return group, loaders


def as_plain_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world: int) -> None:
    """torchrun's environment, no process group (after `group_loaders` faked one)."""
    as_rank(monkeypatch, rank, world)
    monkeypatch.setattr(dataloader_module, "rank_info", lambda: RankInfo(
        rank, world, False) if world > 1 else RankInfo())


def make_loader(cluster: Cluster, n: int = 50, **kwargs: Any) -> Callable[[], tds.DataLoader]:
    kwargs = {"batch_size": 4, "shuffle": True, **kwargs}
    return lambda: tds.DataLoader(Indices(n), service=cluster.target,
                                  generator=torch.Generator().manual_seed(3), **kwargs)


def save_after(monkeypatch: pytest.MonkeyPatch, world: int, make: Callable[[], tds.DataLoader],
               steps: int) -> tuple[dict, list[list[list[int]]]]:
    """Ranks of a world take `steps` batches of epoch 0, then all save: (state, their batches)."""
    group, loaders = group_loaders(monkeypatch, world, make)

    def each(rank: int) -> tuple[dict, list]:
        loaders[rank].set_epoch(0)
        head = epoch(loaders[rank], limit=steps)
        return loaders[rank].state_dict(), head

    results = group.run(each)
    states = [json.dumps(s, sort_keys=True) for s, _ in results]
    assert len(set(states)) == 1, "every rank returns the same state"
    return results[0][0], [head for _, head in results]


@pytest.mark.parametrize("new_world", [3, 1])
def test_a_state_saved_by_two_ranks_resumes_at_another_world_size(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch, new_world: int) -> None:
    n, make = 50, make_loader(cluster)
    state, heads = save_after(monkeypatch, 2, make, steps=3)
    assert state["consumed_ranges"] == [[0, 24]] and state["in_progress"] and state["epoch"] == 0
    buffer = io.BytesIO()
    torch.save(json.loads(json.dumps(state)), buffer)
    buffer.seek(0)
    state = torch.load(buffer)  # plain data: loads with weights_only=True (torch's default)
    before = [i for head in heads for batch in head for i in batch]
    rest, next_epoch, lengths = [], [], []
    for rank in range(new_world):
        as_plain_rank(monkeypatch, rank, new_world)
        loader = make()
        loader.load_state_dict(state)
        loader.set_epoch(0)  # the restored epoch: keeps its position
        lengths.append(len(loader))
        rest.append(epoch(loader))
        assert len(rest[-1]) == lengths[-1]
        loader.set_epoch(1)
        next_epoch.append(epoch(loader))
    assert len(set(lengths)) == 1  # every new rank as many batches
    after = [i for part in rest for batch in part for i in batch]
    assert len(before + after) == len(set(before + after))  # none twice
    assert len(before) + len(after) >= n - (new_world - 1)  # none lost, but the drop
    # The next epoch is an uninterrupted run's at the new world size.
    for rank in range(new_world):
        order = sampling.seeded_default_order(n, True, 3, 1, rank, new_world)
        assert next_epoch[rank] == sampling.batched(order, 4, False)


@pytest.mark.parametrize("policy", [True, "pad", False])
def test_len_and_stats_follow_the_policy_in_a_resumed_epoch(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch, policy: Any) -> None:
    make = make_loader(cluster, n=31, batch_size=3, even_batches=policy)
    state = global_state.encode(0, True, 3, 2, 2, "samples", 31, [(0, 12)])  # 19 left
    counts, samples = [], []
    for rank in range(4):
        as_rank(monkeypatch, rank, 4)
        loader = make()
        loader.load_state_dict(state)
        expected = len(loader)
        got = epoch(loader)
        assert len(got) == expected
        counts.append(len(got))
        samples += [i for batch in got for i in batch]
        stats = loader.stats()
        assert (stats["samples_dropped"], stats["samples_padded"]) == {
            True: (3, 0), "pad": (0, 1), False: (0, 0)}[policy]
        assert len(loader) == 3  # a whole epoch again: 28, 32 or 31 samples over 4 ranks
    if policy is False:
        assert sorted(samples) == sorted(set(samples)) and len(samples) == 19
    else:
        assert len(set(counts)) == 1
        assert len(samples) == (16 if policy is True else 20)


def test_a_state_of_another_dataset_or_sampler_is_refused(cluster: Cluster) -> None:
    state = global_state.encode(0, True, 3, 2, 2, "samples", 50, [(0, 8)])
    with pytest.raises(ValueError, match="epoch of 50 samples .* epoch has 49 samples"):
        make_loader(cluster, n=49)().load_state_dict(state)
    with pytest.raises(ValueError, match="counts 'samples' but this loader deals 'batches'"):
        tds.DataLoader(Indices(50), batch_sampler=[[0, 1]], service=cluster.target
                       ).load_state_dict(state)
    with pytest.raises(ValueError, match="'consumed_ranges'"):
        make_loader(cluster)().load_state_dict({**state, "consumed_ranges": [[0, 51]]})
    with pytest.raises(ValueError, match="'base_seed' must be an int, got '3'"):
        make_loader(cluster)().load_state_dict({**state, "base_seed": "3"})
    with pytest.raises(ValueError, match="even_batches must be .* got 'evenly'"):
        make_loader(cluster, even_batches="evenly")()


def test_a_single_process_resumed_from_a_global_state_saves_a_global_one(
        cluster: Cluster) -> None:
    make = make_loader(cluster, n=30)
    state = global_state.encode(0, True, 3, 2, 2, "samples", 30, [(0, 8)])
    whole = make()
    whole.load_state_dict(state)
    rest = epoch(whole)
    loader = make()
    loader.load_state_dict(state)
    assert loader.state_dict() == state  # not iterated yet: the loaded state
    head = epoch(loader, limit=2)
    again = loader.state_dict()
    assert again["consumed_ranges"] == [[0, 16]] and again["world_size"] == 1
    resumed = make()
    resumed.load_state_dict(again)
    assert head + epoch(resumed) == rest


def test_custom_batch_sampler_batches_are_dealt_whole(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    batch_sampler = [[i, i + 100] for i in range(11)]

    def make() -> tds.DataLoader:
        return tds.DataLoader(Indices(200), batch_sampler=batch_sampler, service=cluster.target)

    state, heads = save_after(monkeypatch, 2, make, steps=2)
    assert (state["unit"], state["length"], state["consumed_ranges"]) == ("batches", 11, [[0, 4]])
    rest = []
    for rank in range(3):
        as_plain_rank(monkeypatch, rank, 3)
        loader = make()
        loader.load_state_dict(state)
        rest.append(epoch(loader))
        assert loader.stats()["batches_dropped"] == 1  # 7 left: one cut for 3 ranks
    got = sorted(b for part in heads + rest for b in part)
    assert got == batch_sampler[:10] and {len(p) for p in rest} == {2}


def test_restart_count_is_part_of_job_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert registration.job_identity("run7") == "run7"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert registration.job_identity("run7") == "run7-restart2"
    registrar = registration.Registrar("x", False, None, "shared", None, None, RankInfo(),
                                       True)
    assert registrar.user_job(3) == "shared-restart2/epoch3/pass0"


def test_pad_gives_every_rank_what_distributed_sampler_gives_it(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    for rank in range(3):
        as_plain_rank(monkeypatch, rank, 3)
        loader = tds.DataLoader(Indices(10), batch_size=None, shuffle=True, even_batches="pad",
                                service=cluster.target, generator=torch.Generator().manual_seed(9))
        sampler = DistributedSampler(Indices(10), num_replicas=3, rank=rank, seed=9)
        assert epoch(loader) == list(sampler) and len(loader) == 4
        assert loader.stats()["samples_padded"] == 2


class Augmented(Indices):
    """A sample and a random number drawn where it is made (a random augmentation)."""

    def __getitem__(self, index: int) -> list:
        return [index, float(torch.rand(()))]


def test_ranks_in_step_resume_their_augmentations_too_at_the_same_world_size(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    def make() -> tds.DataLoader:
        return tds.DataLoader(Augmented(30), batch_size=3, shuffle=True, num_workers=2,
                              collate_fn=list, service=cluster.target,
                              generator=torch.Generator().manual_seed(8))

    state, _ = save_after(monkeypatch, 2, make, steps=2)
    for rank in range(2):
        as_plain_rank(monkeypatch, rank, 2)
        whole = make()
        whole.set_epoch(0)
        resumed = make()
        resumed.load_state_dict(state)
        resumed.set_epoch(0)
        assert epoch(resumed) == epoch(whole)[2:]  # the same samples, the same random numbers

"""Epochs, ranks and resume: set_epoch, torchrun ranks (from the environment), state_dict."""

from __future__ import annotations

import io
import threading

import pytest
import torch

import torch_dataservice as tds
from tests.conftest import Cluster
from tests.torch.builders import Indices, as_rank, epoch
from torch_dataservice.torch import loader_iter


def roundtrip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("use_set_epoch", [False, True], ids=["torch-exact", "set_epoch"])
def test_resume_mid_epoch_loses_and_repeats_nothing(cluster: Cluster, use_set_epoch: bool,
                                                    ) -> None:
    def make() -> tds.DataLoader:
        return tds.DataLoader(Indices(29), batch_size=4, shuffle=True, service=cluster.target,
                              generator=torch.Generator().manual_seed(42))

    def run(loader: tds.DataLoader, first_epoch: int, epochs: int) -> list[list[list[int]]]:
        out = []
        for e in range(first_epoch, epochs):
            if use_set_epoch:
                loader.set_epoch(e)
            out.append(epoch(loader))
        return out

    uninterrupted = run(make(), 0, 3)
    assert uninterrupted[0] != uninterrupted[1]  # epochs are shuffled differently

    interrupted = make()
    run(interrupted, 0, 1)
    if use_set_epoch:
        interrupted.set_epoch(1)
    partial = epoch(interrupted, limit=3)
    state = roundtrip(interrupted.state_dict())
    assert (state["epoch"], state["batches_yielded"], state["in_progress"]) == (1, 3, True)

    restored = make()  # a fresh process would build the loader the same way
    restored.load_state_dict(state)
    rest = run(restored, 1, 3)
    assert partial + rest[0] == uninterrupted[1]
    assert rest[1] == uninterrupted[2]


def test_state_between_epochs_starts_the_next(cluster: Cluster) -> None:
    loader = tds.DataLoader(Indices(10), batch_size=3, shuffle=True, service=cluster.target,
                            generator=torch.Generator().manual_seed(1))
    first = epoch(loader)
    state = loader.state_dict()
    assert (state["epoch"], state["in_progress"]) == (1, False)
    second = epoch(loader)
    restored = tds.DataLoader(Indices(10), batch_size=3, shuffle=True, service=cluster.target,
                              generator=torch.Generator().manual_seed(999))
    restored.load_state_dict(roundtrip(state))
    assert epoch(restored) == second != first


def test_set_epoch_reshuffles_like_distributed_sampler(cluster: Cluster) -> None:
    loader = tds.DataLoader(Indices(12), batch_size=None, shuffle=True, service=cluster.target,
                            generator=torch.Generator().manual_seed(5))
    sampler = torch.utils.data.DistributedSampler(Indices(12), num_replicas=1, rank=0,
                                                  shuffle=True, seed=5)
    for e in (3, 0, 3):
        loader.set_epoch(e)
        sampler.set_epoch(e)
        assert epoch(loader) == list(sampler)


def test_ranks_get_disjoint_equal_parts(cluster: Cluster,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    world_size, n, batch_size = 3, 50, 4  # 50 samples: 2 dropped so that ranks are even
    parts = []
    for rank in range(world_size):
        as_rank(monkeypatch, rank, world_size)
        loader = tds.DataLoader(Indices(n), batch_size=batch_size, shuffle=True,
                                service=cluster.target)
        parts.append([epoch(loader) for _ in range(2)])
        assert len(loader) == len(parts[-1][0])
    for e in range(2):
        batches = [p[e] for p in parts]
        assert len({len(b) for b in batches}) == 1  # equal batch counts: no DDP hang
        samples = [i for b in batches for batch in b for i in batch]
        assert len(samples) == len(set(samples)) == n - n % world_size  # disjoint
    assert parts[0][0] != parts[0][1]  # each epoch is shuffled anew


def test_ranks_deal_out_custom_batch_sampler(cluster: Cluster,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    batch_sampler = [[0], [1, 2], [3, 4, 5], [6], [7, 8], [9]]  # 6 batches, 4 ranks
    got = []
    for rank in range(4):
        as_rank(monkeypatch, rank, 4)
        got.append(epoch(tds.DataLoader(Indices(10), batch_sampler=batch_sampler,
                                        service=cluster.target)))
    assert got == [[[0]], [[1, 2]], [[3, 4, 5]], [[6]]]  # 2 batches dropped for evenness
    as_rank(monkeypatch, 1, 4)
    uneven = tds.DataLoader(Indices(10), batch_sampler=batch_sampler, even_batches=False,
                            service=cluster.target)
    assert epoch(uneven) == [[1, 2], [9]] and len(uneven) == 2


def test_each_rank_restores_its_own_state(cluster: Cluster,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    as_rank(monkeypatch, 1, 2)
    loader = tds.DataLoader(Indices(40), batch_size=3, shuffle=True, service=cluster.target)
    whole = epoch(loader)
    again = tds.DataLoader(Indices(40), batch_size=3, shuffle=True, service=cluster.target)
    head = epoch(again, limit=4)
    state = roundtrip(again.state_dict())
    restored = tds.DataLoader(Indices(40), batch_size=3, shuffle=True, service=cluster.target)
    restored.load_state_dict(state)
    assert head + epoch(restored) == whole
    as_rank(monkeypatch, 0, 2)
    other = tds.DataLoader(Indices(40), batch_size=3, shuffle=True, service=cluster.target)
    with pytest.raises(ValueError, match="rank 1 of 2 cannot resume rank 0"):
        other.load_state_dict(state)


def test_reorder_buffer_restores_positions() -> None:
    def read(arrivals: list, start: int, end: int) -> list[str]:
        got: list[str] = []
        loader_iter.read_positions(iter(arrivals), lambda position, batch: got.append(batch),
                                   list(range(start, end)))
        return got

    arrivals = [(2, "c"), (0, "a"), (4, "e"), (1, "b"), (3, "d"), (6, "g")]
    assert read(arrivals, 0, 7) == ["a", "b", "c", "d", "e", "g"]  # 5 lost with a worker
    assert read(arrivals, 0, 3) == ["a", "b", "c"]  # ends when the last position is out
    assert read([(4, "e"), (3, "d"), (6, "g")], 3, 7) == ["d", "e", "g"]  # resumed after 3


def test_iterable_ranks_share_one_coordinated_job(cluster: Cluster,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    pipeline = tds.Pipeline.range(50)
    loaders = []
    for rank in range(2):  # ranks are fixed at construction; iterated concurrently below
        as_rank(monkeypatch, rank, 2)
        monkeypatch.setenv("MASTER_PORT", "iterable-test")
        # job_name: the two loaders of this one process must name the same job, as the
        # first iterable loader of each rank of a real run does.
        loaders.append(tds.DataLoader(pipeline, batch_size=4, service=cluster.target,
                                      job_name="iterable-test"))
    got: list[list[list[int]]] = [[], []]

    def read(rank: int) -> None:
        got[rank] = [batch.tolist() for batch in loaders[rank]]

    threads = [threading.Thread(target=read, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not any(t.is_alive() for t in threads), "a rank hangs"
    assert len(got[0]) == len(got[1]) == 6  # 13 batches: the incomplete last round is dropped
    # Both ranks report the one batch dropped (an iterable drops whole batches).
    for loader in loaders:
        stats = loader.stats()
        assert (stats["batches_dropped"], stats["samples_dropped"]) == (1, 0), stats
    samples = [i for part in got for batch in part for i in batch]
    assert len(samples) == len(set(samples))
    # Step s: both ranks hold consecutive batches of the worker's stream.
    assert [b[0] for b in got[0]] == [8 * s for s in range(6)]
    assert [b[0] for b in got[1]] == [8 * s + 4 for s in range(6)]

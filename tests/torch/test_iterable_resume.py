"""tds.DataLoader over a DYNAMIC Pipeline: a state made of the splits the trainer yielded
(torch/iterable_state.py), loaded by another loader, yields exactly the rest of the epoch."""

from __future__ import annotations

import itertools
import json
import threading
import time

import pytest

import torch_dataservice as tds
from tests.conftest import Cluster
from torch_dataservice.torch import iterable_state

pytestmark = pytest.mark.timeout(60)
N, BATCH = 120, 4


def samples(batches) -> list[int]:
    return [i for batch in batches for i in batch.tolist()]


@pytest.mark.parametrize("split_size", [None, 8])
def test_a_loaded_split_state_yields_exactly_the_rest(cluster: Cluster, split_size) -> None:
    pipeline = tds.Pipeline.range(N)
    if split_size:
        pipeline = pipeline.with_split_size(split_size)
    loader = tds.DataLoader(pipeline, batch_size=BATCH, service=cluster.target)
    it = iter(loader)
    before = samples(itertools.islice(it, 7))
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["in_progress"] and state["epoch"] == 0 and state["consumed"]
    assert len(json.dumps(state["consumed"])) < 200  # ranges, not per-sample lists
    del it
    resumed = tds.DataLoader(pipeline, batch_size=BATCH, service=cluster.target)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # not started yet: the loaded state
    after = samples(resumed)
    assert sorted(before + after) == list(range(N))
    assert resumed.state_dict()["epoch"] == 1 and not resumed.state_dict()["in_progress"]
    assert sorted(samples(resumed)) == list(range(N))  # the next epoch is whole


def test_the_state_is_what_the_trainer_yielded(cluster: Cluster) -> None:
    pipeline = tds.Pipeline.range(N).with_split_size(8)
    loader = tds.DataLoader(pipeline, batch_size=BATCH, service=cluster.target,
                            max_outstanding_requests=8)
    it = iter(loader)
    before = samples(itertools.islice(it, 3))
    time.sleep(0.3)  # the reader and the loader's queue fill far ahead of 3 batches
    state = loader.state_dict()
    del it
    resumed = tds.DataLoader(pipeline, batch_size=BATCH, service=cluster.target)
    resumed.load_state_dict(state)
    assert sorted(before + samples(resumed)) == list(range(N))


def test_the_default_split_size_is_aligned_to_the_batch_size() -> None:
    assert iterable_state.aligned(tds.Pipeline.range(1000), 3).source.split_size == 9
    assert iterable_state.aligned(tds.Pipeline.range(1000).with_split_size(5), 3) \
        .source.split_size == 5  # the user's choice is kept


def share(epoch: int, finished: bool, consumed: list, sizes: list, yielded: int) -> dict:
    saved = {"epoch": epoch, "batches_yielded": yielded, "in_progress": True, "rng": None,
             "base_seed": None, "seeded": False, "rank": 0, "world_size": 2}
    return {"saved": saved, "finished": finished, "next_epoch": epoch + 1, "next_rng": None,
            "consumed": consumed, "sizes": sizes}


def test_ranks_shares_merge_into_one_state() -> None:
    # Rank 0 read offsets 0-1 of split 3 and split 0 whole; rank 1 offset 2 of split 3 and
    # split 1 in part: split 3 (3 elements) is complete only together.
    a = share(0, False, [{"repetition": 0, "complete": [[0, 1]], "partial": [[3, 2, []]]}],
              [[0, 3, 3]], 3)
    b = share(0, False, [{"repetition": 0, "complete": [], "partial": [[3, 0, [2]],
                                                                      [1, 1, []]]}], [], 2)
    merged = iterable_state._merged([a, b], 2)
    assert merged["consumed"] == [{"repetition": 0, "complete": [[0, 1], [3, 4]],
                                   "partial": [[1, 1, []]]}]
    assert (merged["epoch"], merged["batches_yielded"], merged["in_progress"]) == (0, 5, True)
    assert iterable_state._merged([b, a], 2) == merged  # the same on every rank


def test_a_finished_epoch_saves_the_next_one() -> None:
    done = share(0, True, [], [], 6)
    merged = iterable_state._merged([done, done], 2)
    assert (merged["epoch"], merged["in_progress"], merged["batches_yielded"]) == (1, False, 0)


def test_an_iterable_dataset_read_by_two_ranks_resumes_in_one_process(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.torch.builders import RangeShards, as_rank

    dataset = RangeShards(0, 64)
    loaders = []
    for rank in range(2):  # torchrun's environment, no process group: ranks share one job
        as_rank(monkeypatch, rank, 2)
        monkeypatch.setenv("MASTER_PORT", "iterable-resume-test")
        loaders.append(tds.DataLoader(dataset, batch_size=4, num_workers=2,
                                      service=cluster.target, job_name="iterable-resume"))
    got: list[list[int]] = [[], []]

    def read(rank: int) -> None:
        got[rank] = samples(itertools.islice(iter(loaders[rank]), 3))

    threads = [threading.Thread(target=read, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    # What the collective gathers (all_gather_object), merged as every rank would.
    state = iterable_state._merged([iterable_state._local(loader) for loader in loaders], 2)
    assert state["batches_yielded"] == 6 and state["consumed"]
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("WORLD_SIZE", "1")
    single = tds.DataLoader(dataset, batch_size=4, num_workers=2, service=cluster.target)
    single.load_state_dict(json.loads(json.dumps(state)))
    before = got[0] + got[1]
    assert sorted(before + samples(single)) == list(range(64))


def test_a_count_state_of_the_older_kind_still_resumes_by_count(cluster: Cluster) -> None:
    loader = tds.DataLoader(tds.Pipeline.range(N).with_split_size(8), batch_size=BATCH,
                            service=cluster.target)
    loader.load_state_dict({"epoch": 0, "batches_yielded": 5, "in_progress": True, "rng": None,
                            "base_seed": None, "seeded": False, "rank": 0, "world_size": 1})
    assert loader.state_dict()["batches_yielded"] == 5  # pending, as loaded
    it = iter(loader)
    next(it)
    assert "consumed" not in loader.state_dict()  # that epoch goes on by count
    assert len(samples(it)) == N - 6 * BATCH
    assert loader.state_dict()["epoch"] == 1

"""Cross-trainer cache: one job's elements, computed once, shared by trainer ids.

A byte-bounded sliding window per task serves every trainer; a trainer id never reads an
element twice; eviction moves slow trainers forward; a finite input is an error.
"""

from __future__ import annotations

import itertools

import pytest

import torch_dataservice as tds
from tests.conftest import Cluster
from torch_dataservice.worker.runners import CachingRunner

pytestmark = pytest.mark.integration


def trainer(cluster: Cluster, job: str, trainer_id: str,
            pipeline: tds.Pipeline | None = None, **kw) -> tds.Pipeline:
    pipeline = pipeline if pipeline is not None else tds.Pipeline.range(10**9)
    return pipeline.apply(tds.distribute(
        "parallel_epochs", cluster.target, job_name=job,
        cross_trainer_cache=tds.CrossTrainerCache(trainer_id), **kw))


def cache_of(worker: tds.WorkerServer) -> CachingRunner:
    runners = [t.runner for t in worker._tasks._tasks.values()  # noqa: SLF001 (introspection)
               if isinstance(t.runner, CachingRunner)]
    assert len(runners) == 1
    return runners[0]


def take(pipeline: tds.Pipeline, n: int) -> list:
    iterator = iter(pipeline)
    try:
        return list(itertools.islice(iterator, n))
    finally:
        iterator.close()


def test_trainers_share_one_stream(cluster_factory) -> None:
    cluster = cluster_factory(num_workers=1, num_processes=0)
    a = take(trainer(cluster, "shared", "a"), 100)
    b = take(trainer(cluster, "shared", "b"), 100)
    assert a == b == list(range(100))
    start, length, _ = cache_of(cluster.workers[0]).window
    assert start == 0 and length >= 100


def test_one_trainer_never_reads_an_element_twice(cluster_factory) -> None:
    cluster = cluster_factory(num_workers=1, num_processes=0)
    pipeline = trainer(cluster, "once", "a")
    first = take(pipeline, 30)
    again = take(trainer(cluster, "once", "a"), 30)  # same trainer id, new reader
    assert first == list(range(30))
    assert again[0] >= 30 and again == sorted(set(again))


def test_eviction_moves_a_slow_trainer_forward(cluster_factory) -> None:
    cluster = cluster_factory(num_workers=0, num_processes=0)
    cluster.add_worker(cross_trainer_cache_bytes=4096)
    payload = tds.Pipeline.range(10**9).map(lambda x: (x, b"x" * 200))
    fast = [x for x, _ in take(trainer(cluster, "evict", "fast", payload), 300)]
    start, length, size = cache_of(cluster.workers[0]).window
    assert size <= 4096 + 2 * 256 and start > 0
    slow = [x for x, _ in take(trainer(cluster, "evict", "slow", payload), 20)]
    assert fast == list(range(300))
    assert slow[0] >= start, "the slow trainer starts at the front of the window"
    assert slow == list(range(slow[0], slow[0] + 20))


def test_a_finite_dataset_is_an_error(cluster_factory) -> None:
    cluster = cluster_factory(num_workers=1, num_processes=0)
    with pytest.raises(tds.RemoteError, match="requires the input dataset to be infinite"):
        list(trainer(cluster, "finite", "a", tds.Pipeline.range(5)))


def test_a_cache_needs_a_trainer_id_and_a_job_name(cluster_factory) -> None:
    with pytest.raises(ValueError, match="trainer_id"):
        tds.CrossTrainerCache("")
    with pytest.raises(ValueError, match="job_name"):
        tds.distribute("parallel_epochs", "localhost:1",
                       cross_trainer_cache=tds.CrossTrainerCache("a"))


def test_a_cache_cannot_be_combined_with_coordinated_reads(cluster_factory) -> None:
    cluster = cluster_factory(num_workers=1, num_processes=0)
    with pytest.raises(ValueError, match="coordinated reads"):
        take(trainer(cluster, "cache-rr", "a", consumer_index=0, num_consumers=2), 1)

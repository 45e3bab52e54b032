"""Coordinated reads: strict round robin over `num_consumers` consumers of one job.

In round r one worker produces num_consumers consecutive elements and consumer i receives the
i-th; round r + 1 moves to the next worker. A finite dataset ends at a round boundary for every
consumer: an incomplete last round is dropped, so every consumer gets the same number of
elements.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

import torch_dataservice as tds
from tests.conftest import Cluster

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    from tests.conftest import _make_cluster

    # Executors on threads: one replica per task, so each worker's output is in order.
    made = _make_cluster(2, num_processes=0)
    yield made
    made.stop()


def consume_all(num_consumers: int, make: Callable[[int], tds.Pipeline],
                limit: int | None = None) -> list[list[Any]]:
    results: list[list[Any]] = [[] for _ in range(num_consumers)]
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for element in make(i):
                results[i].append(element)
                if limit is not None and len(results[i]) == limit:
                    break
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(num_consumers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a consumer hangs"
    if errors:
        raise errors[0]
    return results


def coordinated(pipeline: tds.Pipeline, target: str, job: str, mode: Any = "parallel_epochs",
                ) -> Callable[[int], tds.Pipeline]:
    def make(n: int) -> Callable[[int], tds.Pipeline]:
        return lambda i: pipeline.apply(tds.distribute(
            mode, target, job_name=job, consumer_index=i, num_consumers=n))
    return make


@pytest.mark.parametrize("num_consumers", [2, 3])
def test_rounds_alternate_workers_and_consumer_i_gets_the_ith(
        cluster: Cluster, num_consumers: int) -> None:
    n = 20
    make = coordinated(tds.Pipeline.range(n), cluster.target, f"rr-{num_consumers}")
    got = consume_all(num_consumers, make(num_consumers))
    # Each worker runs range(n) (parallel_epochs); round r is served by worker r % 2 from its
    # (r // 2)-th group of num_consumers elements. Incomplete last groups are dropped.
    rounds = 2 * (n // num_consumers)
    for i in range(num_consumers):
        assert got[i] == [num_consumers * (r // 2) + i for r in range(rounds)]


def test_an_infinite_dataset_reads_in_rounds(cluster: Cluster) -> None:
    make = coordinated(tds.Pipeline.range(10**9), cluster.target, "rr-infinite")
    got = consume_all(2, make(2), limit=30)
    for i in range(2):
        assert got[i] == [2 * (r // 2) + i for r in range(30)]


def test_a_finite_dynamic_job_ends_at_the_same_round_for_everyone(cluster: Cluster) -> None:
    # DYNAMIC gives the two workers different amounts of data: a worker that runs out leaves
    # the rotation at the same round for every consumer and the others go on.
    n, consumers = 101, 3
    make = coordinated(tds.Pipeline.range(n), cluster.target, "rr-dynamic",
                       mode="distributed_epoch")
    got = consume_all(consumers, make(consumers))
    lengths = {len(g) for g in got}
    assert len(lengths) == 1, f"consumers got different counts: {[len(g) for g in got]}"
    everything = [x for g in got for x in g]
    assert len(set(everything)) == len(everything), "an element was delivered twice"
    # At most (num_consumers - 1) elements dropped per worker.
    assert len(everything) >= n - 2 * (consumers - 1)


def test_consumers_of_a_round_share_one_worker(cluster: Cluster) -> None:
    # Tag elements with the worker that made them: every round comes from one worker.
    import os
    import threading as th

    def where(x: int) -> tuple[int, str]:
        return x, f"{os.getpid()}-{th.current_thread().name}"

    make = coordinated(tds.Pipeline.range(12).map(where), cluster.target, "rr-where")
    got = consume_all(2, make(2))
    assert len(got[0]) == len(got[1]) == 12
    for r in range(12):
        assert got[0][r][1] == got[1][r][1]
        assert got[0][r][0] + 1 == got[1][r][0]
    assert got[0][0][1] != got[0][1][1], "consecutive rounds come from different workers"


def test_coordinated_reads_with_target_workers_local_is_an_error(cluster: Cluster) -> None:
    with pytest.raises(ValueError, match="target_workers='LOCAL'"):
        list(tds.Pipeline.range(4).apply(tds.distribute(
            "parallel_epochs", cluster.target, job_name="rr-local", consumer_index=0,
            num_consumers=2, target_workers="LOCAL")))


def test_coordinated_reads_need_both_fields_and_a_job_name(cluster: Cluster) -> None:
    with pytest.raises(ValueError, match="consumer_index"):
        tds.distribute("parallel_epochs", cluster.target, job_name="x", consumer_index=0)
    with pytest.raises(ValueError, match="job_name"):
        tds.distribute("parallel_epochs", cluster.target, consumer_index=0, num_consumers=2)

"""A DYNAMIC reader closed right after reading keeps its progress (issue 9.4): close() reports
what it received, so when the idle iteration is collected the splits it held are requeued
without those elements and the job's next reader does not read them again."""

from __future__ import annotations

import itertools
import time

import pytest

import torch_dataservice as tds
from tests.conftest import wait_until

pytestmark = pytest.mark.integration

N = 2000


@pytest.mark.timeout(60)
def test_a_closed_reader_is_not_read_again_after_its_iteration_is_collected(
        cluster_factory) -> None:
    cluster = cluster_factory(num_workers=1, num_processes=1, job_gc_timeout_ms=300,
                              job_gc_check_interval_ms=50)

    def reader() -> tds.Pipeline:  # a new object each time: it joins the job's iteration 0
        return tds.Pipeline.range(N).apply(tds.distribute(
            "distributed_epoch", cluster.target, job_name="closed-early"))

    first = iter(reader())
    consumed = list(itertools.islice(first, 5))
    first.close()
    state = cluster.dispatcher._service.state  # noqa: SLF001 (introspection)
    wait_until(lambda: any(it.garbage_collected for it in state.iterations.values()), 20,
               "the idle iteration to be collected")
    time.sleep(0.2)
    rest = list(reader())
    assert rest, "the job's next reader got nothing"
    assert not set(consumed) & set(rest), (
        f"elements read twice: {sorted(set(consumed) & set(rest))[:10]}")
    assert len(set(rest)) == len(rest) and len(rest) + len(consumed) <= N
    # What it had received and not yielded (its prefetch) was not acknowledged: the next
    # reader gets it, so together they read the epoch exactly once.
    assert sorted(consumed + rest) == list(range(N))

"""A restarted worker under parallel_epochs (OFF) does not end the epoch silently.

As in tf.data service, a worker that restarts at the same address gets a task of every active
iteration again and produces the dataset from the beginning (OFF: every worker produces the
whole dataset), so the reader goes on instead of receiving a clean, truncated end.
"""

from __future__ import annotations

import time

import pytest

import torch_dataservice as tds
from tests.conftest import ProcessCluster

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(90)]

N = 1500


def _slow(x: int) -> int:
    time.sleep(0.002)  # the epoch lasts a few seconds: the worker dies in the middle of it
    return x


def _read_across_a_restart(cluster: ProcessCluster, pipeline: tds.Pipeline,
                           limit: int) -> list[int]:
    worker = cluster.start_worker()
    received: list[int] = []
    for element in pipeline:
        received.append(element)
        if len(received) == 100:
            worker.kill()  # SIGKILL, executors included
            worker.restart()  # same address, a new worker uid
        if len(received) == limit:
            break
    return received


def test_a_restarted_only_worker_starts_its_task_over(process_cluster: ProcessCluster) -> None:
    process_cluster.start_dispatcher("--worker-timeout-ms", "2000")
    pipeline = tds.Pipeline.range(N).map(_slow).apply(
        tds.distribute("parallel_epochs", process_cluster.target))
    received = _read_across_a_restart(process_cluster, pipeline, limit=10 * N)
    # The restarted worker produced the whole dataset again: nothing is missing, and the
    # epoch did not end at the restart (it would have ended at ~101 elements).
    assert set(received) == set(range(N)), (
        f"{len(received)} received, missing e.g. {sorted(set(range(N)) - set(received))[:5]}")
    assert len(received) >= N


def test_a_cross_trainer_cache_job_goes_on_across_a_worker_restart(
        process_cluster: ProcessCluster) -> None:
    process_cluster.start_dispatcher("--worker-timeout-ms", "2000")
    pipeline = tds.Pipeline.range(N).map(_slow).repeat().apply(tds.distribute(
        "parallel_epochs", process_cluster.target, job_name="cache-restart",
        cross_trainer_cache=tds.CrossTrainerCache("trainer-0")))
    received = _read_across_a_restart(process_cluster, pipeline, limit=2 * N + 100)
    assert len(received) == 2 * N + 100  # the infinite cache job did not end at the restart
    # The restarted worker started over: after what the reader had buffered from the killed
    # one, its pass begins at 0 again and holds the whole dataset.
    again = received.index(0, 1)
    assert again >= 100 and set(received[again:again + N]) == set(range(N)), (
        f"restarted at {again}: missing e.g. "
        f"{sorted(set(range(N)) - set(received[again:again + N]))[:5]}")

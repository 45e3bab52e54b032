"""Workers joining and leaving during an epoch.

The pipelines here are gated: elements from `GATE_AT` on wait (bounded) until the test creates
a gate file, and every replica that maps an element leaves a marker file named after it (its
thread is named after its task, and each worker has its own task). So "mid-epoch" is a fact the
test arranges, not a timing guess, and which worker served which element is in the element.

Executors run as threads of the workers (`num_processes=0`): what is tested is the dispatcher
and the reader, and starting executor processes would cost seconds per worker.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cloudpickle
import pytest

import torch_dataservice as tds
from tests.conftest import wait_until

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

cloudpickle.register_pickle_by_value(sys.modules[__name__])

GATE_AT = 10


def gated(directory: str) -> Callable[[int], tuple[int, str]]:
    def fn(x: int) -> tuple[int, str]:
        replica = threading.current_thread().name
        Path(directory, f"replica-{replica}").touch()
        if x >= GATE_AT:
            deadline = time.monotonic() + 30
            while not os.path.exists(os.path.join(directory, "gate")):
                if time.monotonic() > deadline:
                    raise TimeoutError("the test never opened the gate")
                time.sleep(0.01)
        return x, replica

    return fn


def replicas(directory: Path) -> set[str]:
    return {p.name.removeprefix("replica-") for p in directory.glob("replica-*")}


class BackgroundReader:
    """Reads a whole pipeline on a thread, so fetches go on while the test acts."""

    def __init__(self, pipeline: tds.Pipeline) -> None:
        self.received: list[Any] = []
        self.error: BaseException | None = None
        self.finished_at: float | None = None
        self._thread = threading.Thread(target=self._run, args=(pipeline,), daemon=True)
        self._thread.start()

    def _run(self, pipeline: tds.Pipeline) -> None:
        try:
            for element in pipeline:
                self.received.append(element)
        except BaseException as error:
            self.error = error
        finally:
            self.finished_at = time.monotonic()

    def join(self, timeout_s: float) -> list[Any]:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), f"the reader hung; got {len(self.received)}"
        if self.error is not None:
            raise self.error
        return self.received


@pytest.mark.timeout(60)
def test_a_worker_joining_a_parallel_epoch_produces_everything(cluster_factory,
                                                               tmp_path: Path) -> None:
    cluster = cluster_factory(num_workers=1, num_processes=0)
    pipeline = tds.Pipeline.range(20).map(gated(str(tmp_path))).apply(
        tds.distribute("parallel_epochs", cluster.target))
    reader = BackgroundReader(pipeline)
    wait_until(lambda: len(reader.received) >= 5, 30, "the first worker's elements")
    (first,) = replicas(tmp_path)
    cluster.add_worker()
    wait_until(lambda: len(replicas(tmp_path)) == 2, 30, "the new worker to start")
    (tmp_path / "gate").touch()
    received = reader.join(30)
    assert Counter(x for x, _ in received) == Counter({x: 2 for x in range(20)})
    by_replica = Counter(replica for _, replica in received)
    assert by_replica[first] == 20 and len(by_replica) == 2  # the newcomer started from the start


@pytest.mark.timeout(60)
def test_a_worker_joining_a_distributed_epoch_takes_splits(cluster_factory,
                                                           tmp_path: Path) -> None:
    cluster = cluster_factory(num_workers=1, num_processes=0)
    pipeline = tds.Pipeline.range(60).map(gated(str(tmp_path))).apply(
        tds.distribute("distributed_epoch", cluster.target))
    reader = BackgroundReader(pipeline)
    wait_until(lambda: len(reader.received) >= 5, 30, "the first worker's elements")
    (first,) = replicas(tmp_path)
    cluster.add_worker()
    # The newcomer holds a split (it mapped an element of it) while the first worker waits.
    wait_until(lambda: len(replicas(tmp_path)) == 2, 30, "the new worker to take a split")
    (tmp_path / "gate").touch()
    received = reader.join(30)
    assert sorted(x for x, _ in received) == list(range(60))
    by_replica = Counter(replica for _, replica in received)
    assert len(by_replica) == 2 and by_replica[first] < 60
    (newcomer,) = set(by_replica) - {first}
    # It joined mid-epoch: the splits before the gate were taken already.
    assert min(x for x, replica in received if replica == newcomer) >= GATE_AT


@pytest.mark.timeout(60)
def test_a_worker_stopped_mid_epoch_does_not_hang_the_consumer(cluster_factory,
                                                               tmp_path: Path) -> None:
    worker_timeout_ms = 1000
    cluster = cluster_factory(num_workers=2, num_processes=0,
                              worker_timeout_ms=worker_timeout_ms)
    source = tds.Pipeline.range(60)
    pipeline = source.map(gated(str(tmp_path))).apply(
        tds.distribute("distributed_epoch", cluster.target))
    reader = BackgroundReader(pipeline)
    wait_until(lambda: len(replicas(tmp_path)) == 2, 30, "both workers to take splits")
    stopped = cluster.workers[1]
    cluster.stop_worker(stopped)
    stopped_at = time.monotonic()
    (tmp_path / "gate").touch()
    received = reader.join(30)
    assert reader.finished_at is not None
    assert reader.finished_at - stopped_at < worker_timeout_ms / 1000 + 10
    values = [x for x, _ in received]
    assert len(values) == len(set(values)) and set(values) <= set(range(60))  # at most once
    # Only the split the stopped worker held (and what it had buffered) may be missing.
    assert len(values) >= 60 - 2 * source.split_size
    # The survivors serve the next job normally.
    assert sorted(tds.Pipeline.range(10).apply(
        tds.distribute("distributed_epoch", cluster.target))) == list(range(10))

"""Real processes through the CLI: the dispatcher killed and restarted, workers killed mid-epoch.

Each test reads a DYNAMIC epoch of range(n) in a consumer subprocess and asserts every element
arrived exactly once.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.conftest import ProcessCluster
from tests.fault.helpers import Consumer

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(120)]

N = 30_000


def test_dispatcher_killed_mid_epoch_restarts_from_its_journal(
        process_cluster: ProcessCluster, tmp_path: Path) -> None:
    dispatcher = process_cluster.start_dispatcher(
        "--fault-tolerant", "--work-dir", str(tmp_path / "work"), "--worker-timeout-ms", "3000")
    process_cluster.start_workers(2)
    consumer = Consumer(process_cluster, N, tmp_path / "out.txt", "restart")
    assert consumer.wait_received(N // 5, 60), consumer.output()
    dispatcher.signal(signal.SIGKILL)
    dispatcher.wait_exit()
    dispatcher.restart()  # same port, same work dir: replays the journal
    result = consumer.wait(60)
    assert result.done and result.missing == 0 and result.duplicated == 0, (
        f"{result}\n{consumer.output()}\n{dispatcher.output[-3000:]}")
    assert "registered" not in dispatcher.output  # workers were known by uid from the journal


def test_a_worker_killed_mid_epoch_loses_and_repeats_nothing(
        process_cluster: ProcessCluster, tmp_path: Path) -> None:
    dispatcher = process_cluster.start_dispatcher("--worker-timeout-ms", "1000")
    workers = process_cluster.start_workers(3)
    # Read slower than the workers make elements: each one's buffer fills and its executor
    # waits in the middle of a split, so the killed worker surely holds one. (Unthrottled, on
    # a loaded machine, it was once killed between two splits, with nothing to requeue.)
    consumer = Consumer(process_cluster, N, tmp_path / "out.txt", "worker-death", max_rate=8000)
    assert consumer.wait_received(N // 4, 60), consumer.output()
    workers[0].kill()  # not restarted: declared dead after 1 s, its splits handed again
    result = consumer.wait(60)
    assert result.done and result.missing == 0 and result.duplicated == 0, (
        f"{result}\n{consumer.output()}\n{dispatcher.output[-3000:]}")
    assert "requeued" in dispatcher.output, dispatcher.output

"""An executor process killed while its replica holds DYNAMIC splits (cheap splits are asked for
several at a time, worker/replica_splits.py): the read fails naming the dead executor, and
nothing delivered before comes twice."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import torch_dataservice as tds
from tests.conftest import wait_until
from torch_dataservice.errors import RemoteError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

GATE_AT = 40  # batches: the replica stops at this one, holding the splits asked for ahead


def gated(directory: str) -> Callable[[list[int]], int]:
    def fn(batch: list[int]) -> int:
        first = int(batch[0])
        if first >= GATE_AT * 16:
            Path(directory, "waiting").touch()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # killed before it ends
                time.sleep(0.01)
        return first

    return fn


def test_an_executor_killed_while_holding_splits_fails_the_read_once(
        cluster_factory, tmp_path: Path) -> None:
    cluster = cluster_factory(num_workers=1, num_processes=1)
    # One batch of 16 per split: cheap splits, so the replica asks for several at once.
    pipeline = tds.Pipeline.range(16 * 400).with_split_size(16).batch(16).map(
        gated(str(tmp_path))).apply(tds.distribute("distributed_epoch", cluster.target))
    received: list[int] = []
    with pytest.raises(RemoteError, match="executor process running this task died"):
        for first in pipeline:
            received.append(first)
            if len(received) == GATE_AT:
                worker = cluster.workers[0]
                tasks = worker._tasks  # noqa: SLF001 - the front's view of the replica
                (task_id,) = tasks.task_ids()
                task = tasks.get(task_id)
                wait_until(lambda: (tmp_path / "waiting").exists(), 30, "the gate")
                # Handed to the replica and not finished: the one it reads and any it holds
                # (how many it holds then depends on timing: the split stock may be waiting for
                # the dispatcher; tests/worker/test_replica_asks.py checks the hold itself).
                with task.cond:
                    open_splits = len(task.state.order._open.get(0, []))  # noqa: SLF001
                assert open_splits >= 1, open_splits
                pid = tasks._executors._slot(0).process.pid  # noqa: SLF001
                os.kill(pid, signal.SIGKILL)
    assert received == sorted(set(received))  # in order, none twice
    assert received == [16 * i for i in range(GATE_AT)]

"""Chaos: a DYNAMIC epoch of 60,000 elements while workers are SIGKILLed and restarted every
few seconds and the dispatcher is SIGKILLed and restarted once, read by two consumers sharing
the job. Every process is a CLI subprocess on 127.0.0.1. Asserts no element missing and none
duplicated across the two.

The chaos phase is bounded by CHAOS_BUDGET_S from the first element received; process
start-up (interpreters importing torch) comes on top and depends on the machine's load.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.conftest import ProcessCluster
from tests.fault.helpers import Consumer, received, tally_all

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]

N = 60_000
MAX_RATE = 1_500.0  # elements/s per consumer: the epoch lasts >= 20 s, faults land inside it
CHAOS_BUDGET_S = 90.0
KILL_EVERY_S = 2.0


def test_chaos_epoch_is_exactly_once(process_cluster: ProcessCluster, tmp_path: Path) -> None:
    dispatcher = process_cluster.start_dispatcher(
        "--fault-tolerant", "--work-dir", str(tmp_path / "work"), "--worker-timeout-ms", "1500")
    workers = process_cluster.start_workers(3)
    outs = [tmp_path / f"out{i}.txt" for i in range(2)]
    consumers = [Consumer(process_cluster, N, out, "chaos", MAX_RATE) for out in outs]
    consumer = consumers[0]
    assert all(c.wait_received(1, 90) for c in consumers), consumer.output()

    def total_received() -> int:
        return sum(received(out) for out in outs)

    start = time.monotonic()
    worker_kills = dispatcher_kills = 0
    timeline = []
    while consumer.proc.poll() is None and time.monotonic() - start < CHAOS_BUDGET_S - 15:
        time.sleep(KILL_EVERY_S)
        timeline.append((round(time.monotonic() - start, 1), total_received()))
        if consumer.proc.poll() is not None:
            break
        if dispatcher_kills == 0 and total_received() > N // 3:
            dispatcher.signal(signal.SIGKILL)
            dispatcher.wait_exit()
            dispatcher.restart()  # same port and work dir: replays the journal
            dispatcher_kills += 1
            continue
        victim = workers[worker_kills % len(workers)]
        victim.kill()
        victim.restart()  # same port, new process: a new worker uid
        worker_kills += 1
    for c in consumers:
        c.wait(max(1.0, CHAOS_BUDGET_S - (time.monotonic() - start)))
    result = tally_all(outs, N)
    elapsed = time.monotonic() - start
    print(f"\nchaos: {result} worker_kills={worker_kills} dispatcher_kills={dispatcher_kills} "
          f"chaos phase {elapsed:.1f}s; timeline (s, received): {timeline}")
    assert result.done, (f"{result}\n{consumer.output()}\n{consumers[1].output()}\n"
                         f"{dispatcher.output[-3000:]}")
    assert result.missing == 0 and result.duplicated == 0, str(result)
    # A worker restart waits for the new process to serve (seconds on a loaded machine).
    assert worker_kills >= 2 and dispatcher_kills == 1, "the epoch ended before the chaos"

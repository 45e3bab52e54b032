"""Chaos: two DYNAMIC epochs of 30,000 elements through a pipeline with `cache()`, while workers
are SIGKILLed and restarted every few seconds, and (in epoch 2, read from the workers' caches
with splits handed to their holders) the dispatcher is SIGKILLed and restarted once. Each epoch
is read by two consumers sharing its job; every process is a CLI subprocess on 127.0.0.1.
Asserts, per epoch, no element missing and none duplicated across the two, and that epoch 2
read part of its elements from a cache (a killed worker takes its cache with it).

The chaos phase of an epoch is bounded by CHAOS_BUDGET_S from its first element; process
start-up (interpreters importing torch) comes on top and depends on the machine's load.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.conftest import ProcessCluster, ServerProcess
from tests.fault.helpers import Consumer, Tally, received, tally_all

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

N = 30_000
MAX_RATE = 1_500.0  # elements/s per consumer: an epoch lasts >= 10 s, faults land inside it
CHAOS_BUDGET_S = 60.0
KILL_EVERY_S = 2.0


def computed(directory: Path) -> int:
    """How many elements the step before the cache computed (not read from a cache)."""
    return sum(len(f.read_text().splitlines()) for f in directory.iterdir())


def chaos_epoch(cluster: ProcessCluster, dispatcher: ServerProcess,
                workers: list[ServerProcess], directory: Path, cache_log: Path,
                kill_dispatcher: bool) -> tuple[Tally, int, int, str]:
    """One epoch under worker kills (and one dispatcher kill): its tally, the kills, and the
    consumers' and dispatcher's output for a failure message. `cache_log` is in the pipeline
    (the step before the cache writes there): the same for every epoch, or the pipeline, its
    fingerprint and its cache key would differ."""
    directory.mkdir()
    outs = [directory / f"out{i}.txt" for i in range(2)]
    consumers = [Consumer(cluster, N, out, directory.name, MAX_RATE, cache_dir=cache_log)
                 for out in outs]
    assert all(c.wait_received(1, 90) for c in consumers), consumers[0].output()

    def total_received() -> int:
        return sum(received(out) for out in outs)

    start = time.monotonic()
    worker_kills = dispatcher_kills = 0
    while (all(c.proc.poll() is None for c in consumers)
           and time.monotonic() - start < CHAOS_BUDGET_S - 15):
        if kill_dispatcher and dispatcher_kills == 0:
            # The dispatcher's kill comes first, a third into the epoch: a worker's restart
            # before it can take as long as the rest of a cached epoch on a loaded machine.
            if total_received() <= N // 3:
                time.sleep(0.05)
                continue
            dispatcher.signal(signal.SIGKILL)
            dispatcher.wait_exit()
            dispatcher.restart()  # same port and work dir: replays the journal
            dispatcher_kills += 1
            continue
        time.sleep(KILL_EVERY_S)
        if any(c.proc.poll() is not None for c in consumers):
            break
        victim = workers[worker_kills % len(workers)]
        victim.kill()
        victim.restart()  # same port, new process: a new worker uid and an empty cache
        worker_kills += 1
    for c in consumers:
        c.wait(max(1.0, CHAOS_BUDGET_S - (time.monotonic() - start)))
    result = tally_all(outs, N)
    output = "\n".join([*(c.output() for c in consumers), dispatcher.output[-3000:]])
    print(f"\n{directory.name}: {result} worker_kills={worker_kills} "
          f"dispatcher_kills={dispatcher_kills} computed so far={computed(cache_log)} "
          f"in {time.monotonic() - start:.1f}s")
    return result, worker_kills, dispatcher_kills, output


def test_chaos_epochs_with_a_cache_are_exactly_once(process_cluster: ProcessCluster,
                                                    tmp_path: Path) -> None:
    dispatcher = process_cluster.start_dispatcher(
        "--fault-tolerant", "--work-dir", str(tmp_path / "work"), "--worker-timeout-ms", "1500")
    workers = process_cluster.start_workers(3)
    (cache_log := tmp_path / "computed").mkdir()
    computed_before = 0
    for epoch, kill_dispatcher in ((1, False), (2, True)):
        computed_before = computed(cache_log)
        result, worker_kills, dispatcher_kills, output = chaos_epoch(
            process_cluster, dispatcher, workers, tmp_path / f"chaos-{epoch}", cache_log,
            kill_dispatcher)
        assert result.done, f"epoch {epoch}: {result}\n{output}"
        assert result.missing == 0 and result.duplicated == 0, f"epoch {epoch}: {result}"
        # A worker restart waits for the new process to serve (seconds on a loaded machine);
        # epoch 2 also restarts the dispatcher, and reads faster (from the caches).
        assert worker_kills >= 3 - epoch and dispatcher_kills == int(kill_dispatcher), (
            f"epoch {epoch} ended before the chaos")
    # Epoch 2 read from the caches of the workers not killed since they computed a split.
    assert computed(cache_log) - computed_before < N

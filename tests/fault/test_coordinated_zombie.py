"""Coordinated reads under DYNAMIC when a worker is declared dead but is not (a zombie: here a
SIGSTOP of its process group past --worker-timeout-ms, as a loaded machine does by accident):
nothing is delivered twice. Real CLI processes."""

from __future__ import annotations

import collections
import os
import signal
import threading
import time

import pytest

from tests.conftest import ProcessCluster, wait_until
from tests.fault.helpers import read_coordinated

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]


def _read(target: str, consumer: int, got: list, errors: list, stop: threading.Event) -> None:
    read_coordinated(target, "distributed_epoch", "zombie", consumer, got, errors, stop)


def _wait(got: list[list], errors: list, counts: list[int], what: str) -> None:
    deadline = time.monotonic() + 60
    while any(len(g) < c for g, c in zip(got, counts, strict=True)) and not errors:
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: {[len(g) for g in got]} read, wanted {counts}")
        time.sleep(0.02)


def test_a_zombie_worker_delivers_nothing_twice(process_cluster: ProcessCluster) -> None:
    dispatcher = process_cluster.start_dispatcher("--worker-timeout-ms", "1000")
    workers = [process_cluster.start_worker() for _ in range(2)]
    got: list[list[tuple[int, int]]] = [[], []]
    errors: list[BaseException] = []
    stop = threading.Event()
    threads = [threading.Thread(target=_read, args=(process_cluster.target, i, got[i], errors,
                                                    stop), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    try:
        _wait(got, errors, [40, 40], "before the freeze")
        os.killpg(workers[0].proc.pid, signal.SIGSTOP)  # declared dead after 1 s
        wait_until(lambda: "missed heartbeats" in dispatcher.output, 30,
                   "the frozen worker removed")
        os.killpg(workers[0].proc.pid, signal.SIGCONT)  # back: registers again
        _wait(got, errors, [len(g) + 300 for g in got], "after the freeze")
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not errors, f"a consumer failed: {errors[0]!r}"
    every = [x for g in got for _, x in g]
    twice = sorted(x for x, n in collections.Counter(every).items() if n > 1)
    assert not twice, f"{len(twice)} element(s) delivered twice, e.g. {twice[:10]}"

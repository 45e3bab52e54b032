"""Coordinated reads take in workers that join mid-read (issue 9.5): a new worker, and every
original worker restarted one after the other (a rolling restart), serve a running
coordinated read, which keeps strict rounds throughout. Real CLI processes."""

from __future__ import annotations

import threading
import time

import pytest

from tests.conftest import ProcessCluster
from tests.fault.helpers import read_coordinated

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]


def _read(target: str, consumer: int, got: list, errors: list, stop: threading.Event) -> None:
    read_coordinated(target, "parallel_epochs", "membership", consumer, got, errors, stop)


def _start_readers(target: str, first: int) -> tuple[list, list, threading.Event, list]:
    """Two coordinated consumers on threads, once each has read `first` elements."""
    got: list[list[tuple[int, int]]] = [[], []]
    errors: list[BaseException] = []
    stop = threading.Event()
    threads = [threading.Thread(target=_read, args=(target, i, got[i], errors, stop),
                                daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while min(len(g) for g in got) < first and not errors:
        if time.monotonic() > deadline:
            stop.set()
            pytest.fail(f"no progress: {[len(g) for g in got]}")
        time.sleep(0.02)
    return got, errors, stop, threads


def _wait_for_new_pid(got: list[list], known: set[int], errors: list, what: str) -> int:
    """Wait until both consumers received elements from an executor not in `known`."""
    deadline = time.monotonic() + 60
    marks = [len(g) for g in got]
    while time.monotonic() < deadline and not errors:
        fresh = [{pid for pid, _ in g[m:]} - known for g, m in zip(got, marks, strict=True)]
        common = fresh[0] & fresh[1]
        if common:
            return common.pop()
        time.sleep(0.05)
    pytest.fail(f"{what}: no consumer read from it within 60s "
                f"({[len(g) for g in got]} read; errors {errors})")


def test_new_and_restarted_workers_join_a_running_coordinated_read(
        process_cluster: ProcessCluster) -> None:
    process_cluster.start_dispatcher("--worker-timeout-ms", "1000")
    workers = [process_cluster.start_worker() for _ in range(2)]
    got, errors, stop, threads = _start_readers(process_cluster.target, 40)
    try:
        original = {pid for pid, _ in got[0]}
        assert len(original) == 2, f"rounds did not visit both workers: {original}"
        known = set(original)
        process_cluster.start_worker()  # a worker added to the running read
        known.add(_wait_for_new_pid(got, known, errors, "the added worker"))
        restarted = set()
        for worker in workers:  # a rolling restart of every original worker
            worker.kill()
            worker.restart()
            pid = _wait_for_new_pid(got, known, errors, "a restarted worker")
            known.add(pid)
            restarted.add(pid)
        marks = [len(g) for g in got]
        time.sleep(1.0)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not errors, f"a consumer failed: {errors[0]!r}"
    for consumer in range(2):
        tail = {pid for pid, _ in got[consumer][marks[consumer]:]}
        assert not tail & original, "elements from a killed worker after the rolling restart"
        assert restarted <= tail, f"consumer {consumer} does not read every restarted worker"
    # Strict rounds throughout: each worker's elements 2k and 2k+1 form a round, element 2k
    # to consumer 0 and 2k+1 to consumer 1.
    assert all(x % 2 == 0 for _, x in got[0]) and all(x % 2 == 1 for _, x in got[1]), \
        "a consumer got another consumer's element of a round"


def test_the_only_worker_restarted_takes_its_own_place(process_cluster: ProcessCluster) -> None:
    process_cluster.start_dispatcher("--worker-timeout-ms", "1000")
    worker = process_cluster.start_worker()
    got, errors, stop, threads = _start_readers(process_cluster.target, 20)
    try:
        original = {pid for pid, _ in got[0]}
        worker.kill()
        worker.restart()
        _wait_for_new_pid(got, original, errors, "the restarted worker")
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not errors, f"a consumer failed: {errors[0]!r}"
    assert all(x % 2 == 0 for _, x in got[0]) and all(x % 2 == 1 for _, x in got[1])

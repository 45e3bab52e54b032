"""Coordinated reads go on when a worker is killed: every consumer drops the lost task at the
same round (dispatcher/coordinated.py `note_blocked`), and rounds stay one-worker-per-round.

Real processes: a dispatcher and three workers through the CLI, one killed with SIGKILL while
two consumers read in rounds.
"""

from __future__ import annotations

import threading
import time

import pytest

import torch_dataservice as tds
from tests.conftest import ProcessCluster
from tests.fault.helpers import tag_with_pid

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

READ_PER_CONSUMER = 400


def read_in_rounds(target: str, job: str, consumer: int, got: list, errors: list,
                   stop: threading.Event) -> None:
    pipeline = tds.Pipeline.range(10**9).map(tag_with_pid).apply(tds.distribute(
        "parallel_epochs", target, job_name=job, consumer_index=consumer, num_consumers=2))
    try:
        for element in pipeline:
            got.append(element)
            if len(got) >= READ_PER_CONSUMER or stop.is_set():
                return
            time.sleep(0.005)  # a training step: the kill lands mid-stream
    except BaseException as error:  # noqa: BLE001 - reported by the test
        errors.append(error)


def test_coordinated_reads_survive_a_killed_worker(process_cluster: ProcessCluster) -> None:
    process_cluster.start_dispatcher("--worker-timeout-ms", "1000")
    workers = [process_cluster.start_worker() for _ in range(3)]
    got: list[list[tuple[int, int]]] = [[], []]
    errors: list[BaseException] = []
    stop = threading.Event()
    threads = [threading.Thread(target=read_in_rounds, args=(
        process_cluster.target, "rounds-loss", i, got[i], errors, stop)) for i in range(2)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + 60
        while min(len(g) for g in got) < 60 and not errors:
            assert time.monotonic() < deadline, f"no progress: {[len(g) for g in got]}"
            time.sleep(0.02)
        pids_before = {pid for pid, _ in got[0]}
        assert len(pids_before) == 3, f"rounds did not visit all three workers: {pids_before}"
        at_kill = [len(g) for g in got]
        # Which pid is the victim's: the workers' executors are their only descendants (forked
        # by each worker's fork server, a child of the worker).
        victim = workers[1]
        victim_pids = {pid for pid in pids_before
                       if victim.proc.pid in (_parent(pid), _parent(_parent(pid)))}
        assert len(victim_pids) == 1, f"executor of the victim not found among {pids_before}"
        victim.kill()
        for thread in threads:
            thread.join(90)
        assert not any(thread.is_alive() for thread in threads), \
            f"a consumer hangs after the kill: {[len(g) for g in got]}"
    finally:
        stop.set()
    assert not errors, f"a consumer failed: {errors[0]!r}"
    assert [len(g) for g in got] == [READ_PER_CONSUMER] * 2

    # After the loss both consumers keep reading, from the two surviving workers only.
    for consumer in range(2):
        tail = got[consumer][at_kill[consumer] + 40:]
        assert len(tail) > 100, f"consumer {consumer} barely read after the kill"
        tail_pids = {pid for pid, _ in tail}
        assert not tail_pids & victim_pids, "elements from the killed worker after its removal"
        assert len(tail_pids) == 2, f"consumer {consumer} read {tail_pids} after the kill"
    # Strict rounds, before and after the loss: each worker's elements 2k and 2k+1 form a round,
    # element 2k to consumer 0 and 2k+1 to consumer 1. A round of a live worker reached both
    # consumers, except at the very end: each stopped at its 400th element, and the one that
    # read more of the dead worker's half-read rounds stopped that many rounds earlier.
    first, second = set(got[0]), set(got[1])
    assert all(x % 2 == 0 for _, x in got[0]) and all(x % 2 == 1 for _, x in got[1]), \
        "a consumer got another consumer's element of a round"
    dead = [sum(pid in victim_pids for pid, _ in g) for g in got]
    only_first = [(p, x) for p, x in got[0] if p not in victim_pids and (p, x + 1) not in second]
    only_second = [(p, x) for p, x in got[1] if p not in victim_pids and (p, x - 1) not in first]
    assert len(only_first) <= dead[1] + 1, f"rounds that reached consumer 0 only: {only_first}"
    assert len(only_second) <= dead[0] + 1, f"rounds that reached consumer 1 only: {only_second}"
    # ... and those are the last rounds each read, not gaps in the middle.
    for consumer, stray in ((0, only_first), (1, only_second)):
        assert all(got[consumer].index(e) >= READ_PER_CONSUMER - len(stray) - dead[1 - consumer]
                   for e in stray), f"consumer {consumer} has a round the other skipped: {stray}"


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1

"""Coordinated reads survive tf.data service's own fault sequence (its coordinated-read
fault-tolerance test): three consumers reading in rounds from two workers; each worker in turn
stopped and restarted on its port; a third worker added; the fault-tolerant dispatcher
restarted; then both original workers stopped. Ten rounds are read after every step, by one
thread that takes one element from each consumer in turn (as tf.data's test interleaves them),
so a consumer waiting on a lost worker's round leaves the others' buffers full. Real CLI
processes."""

from __future__ import annotations

import signal
from collections.abc import Callable

import pytest

import torch_dataservice as tds
from tests.conftest import ProcessCluster, ServerProcess
from tests.fault.test_coordinated_worker_loss import tag_with_pid

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(300)]

CONSUMERS = 3
ROUNDS_PER_STEP = 10
STEPS = 6


def _drain(worker: ServerProcess) -> None:
    """tf.data's stop(): the worker leaves gracefully (SIGTERM: a short drain)."""
    worker.signal(signal.SIGTERM)
    worker.wait_exit()


def _read_the_sequence(cluster: ProcessCluster, work_dir: str, mode: str,
                       stop: Callable[[ServerProcess], None],
                       outstanding: int | None = None) -> list[list[tuple[int, int]]]:
    """The rounds read, each as the (pid, element) of every consumer."""
    dispatcher = cluster.start_dispatcher(
        "--fault-tolerant", "--work-dir", work_dir, "--worker-timeout-ms", "1000")
    workers = cluster.start_workers(2, "--drain-timeout-s", "1")
    readers = [iter(tds.Pipeline.range(10**9).map(tag_with_pid).apply(tds.distribute(
        mode, cluster.target, job_name="sequence", consumer_index=i, num_consumers=CONSUMERS,
        max_outstanding_requests=outstanding))) for i in range(CONSUMERS)]
    rounds: list[list[tuple[int, int]]] = []

    def read_rounds(step: str) -> None:
        for _ in range(ROUNDS_PER_STEP):
            try:
                rounds.append([next(reader) for reader in readers])
            except Exception as error:
                raise AssertionError(f"{step}: round {len(rounds)} failed: {error!r}") from error

    read_rounds("start")
    for i, worker in enumerate(workers):
        stop(worker)
        worker.restart()
        read_rounds(f"worker {i} restarted")
    cluster.start_worker()
    read_rounds("a worker added")
    dispatcher.kill()
    dispatcher.restart()
    read_rounds("the dispatcher restarted")
    for worker in workers:
        stop(worker)
    read_rounds("both original workers stopped")
    assert len(rounds) == STEPS * ROUNDS_PER_STEP
    return rounds


@pytest.mark.parametrize("mode", ["parallel_epochs", "distributed_epoch"])
def test_workers_that_leave_gracefully_keep_the_consumers_in_lockstep(
        process_cluster: ProcessCluster, tmp_path, mode: str) -> None:
    rounds = _read_the_sequence(process_cluster, str(tmp_path / "work"), mode, _drain)
    # Each round is one group of consecutive elements of one worker, consumer i the i-th.
    for r, elements in enumerate(rounds):
        values = [x for _, x in elements]
        aligned = mode != "parallel_epochs" or values[0] % CONSUMERS == 0  # range() per worker
        assert len({pid for pid, _ in elements}) == 1 and aligned \
            and values == list(range(values[0], values[0] + CONSUMERS)), \
            f"round {r} is not one worker's group of {CONSUMERS}: {elements}\nall: {rounds}"
    everything = [e for elements in rounds for e in elements]
    assert len(set(everything)) == len(everything), "an element was delivered twice"


# One outstanding request is a path of the consumer's rounds (client/rounds.py), the same in
# every mode: it runs with parallel_epochs, whose elements also show each consumer's own group;
# distributed_epoch's requeued splits after a kill are the (None) variant's.
@pytest.mark.parametrize(("mode", "outstanding"), [
    ("parallel_epochs", None), ("distributed_epoch", None), ("parallel_epochs", 1)])
def test_workers_killed_in_the_sequence_lose_only_their_unfinished_rounds(
        process_cluster: ProcessCluster, tmp_path, mode: str, outstanding: int | None) -> None:
    """With one outstanding request, a consumer whose round reached it before the kill holds
    it, and its fetch waits for that slot at the next round: it reaches a lost worker's round
    only when the application takes from it, which a reader taking in turn does not do while
    another consumer waits on that lost round."""
    rounds = _read_the_sequence(process_cluster, str(tmp_path / "work"), mode,
                                ServerProcess.kill, outstanding)
    # A worker killed mid-round leaves that round read by some consumers only (its elements
    # died with it); every other round reaches every consumer, whole.
    if mode == "parallel_epochs":  # each worker's stream is range(): its groups are known
        for i in range(CONSUMERS):
            assert all(x % CONSUMERS == i for elements in rounds for _, x in elements[i:i + 1]), \
                f"consumer {i} got another consumer's element: {rounds}"
    # Per worker, consumer i's k-th element and consumer j's k-th are of one round, and one
    # consumer's rounds of it are the first ones of another's: none skipped in the middle.
    for pid in {pid for elements in rounds for pid, _ in elements}:
        mine = [[x for p, x in (elements[i] for elements in rounds) if p == pid]
                for i in range(CONSUMERS)]
        for i in range(1, CONSUMERS):
            assert all(b - a == i for a, b in zip(mine[0], mine[i], strict=False)), \
                f"worker {pid}: consumers 0 and {i} read different rounds: {mine}\n{rounds}"
    assert rounds[-1][0][0] not in {pid for pid, _ in rounds[0]}, "read a killed worker"
    everything = [e for elements in rounds for e in elements]
    assert len(set(everything)) == len(everything), "an element was delivered twice"

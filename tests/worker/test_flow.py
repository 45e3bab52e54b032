"""Flow control per batch of elements (worker/flow.py): credits return in batches (and at once
to a replica that says it is blocked), fetches of a steady pipeline carry several elements."""

from __future__ import annotations

import threading
import time

import pytest

import torch_dataservice as tds
from torch_dataservice.proto import common_pb2
from torch_dataservice.worker import flow, tasks
from torch_dataservice.worker.flow import Arrivals, CreditLedger
from torch_dataservice.worker.messages import Credit
from torch_dataservice.worker.task_state import (
    BufferedElement,
    ElementsArrived,
    Started,
    WorkerTask,
)


def test_credits_go_in_batches_by_count_or_bytes() -> None:
    ledger = CreditLedger(batch=3, batch_bytes=100)
    ledger.taken(0, 10)
    ledger.taken(0, 10)
    ledger.taken(1, 10)
    assert ledger.due() == []
    ledger.taken(0, 10)
    assert ledger.due() == [(0, 3)]
    ledger.taken(1, 95)  # 105 bytes owed to replica 1
    assert ledger.due() == [(1, 2)]
    assert ledger.due() == []


def test_a_blocked_replica_gets_what_it_is_owed_or_its_next_credit_at_once() -> None:
    ledger = CreditLedger(batch=100)
    ledger.taken(0, 1)
    assert ledger.blocked(0) == 1  # owed: sent now
    assert ledger.blocked(0) == 0  # owed nothing yet: remembered
    ledger.taken(0, 1)
    assert ledger.due() == [(0, 1)]
    ledger.taken(0, 1)
    assert ledger.due() == []  # not blocked any more: batched again
    ledger.ended(0)
    assert ledger.due() == [] and ledger.blocked(1) == 0


def test_arrivals_are_steady_when_a_linger_gathers_more_than_one() -> None:
    arrivals = Arrivals()
    assert not arrivals.steady()
    for k in range(10):
        arrivals.note(k * flow.LINGER_S / 4)
    assert arrivals.steady()
    for k in range(10, 40):
        arrivals.note(k * flow.LINGER_S * 4)
    assert not arrivals.steady()


def slow(x: int) -> int:
    time.sleep(0.0005)
    return x


@pytest.mark.timeout(60)
def test_a_steady_slow_pipeline_is_fetched_and_credited_in_batches(cluster_factory,
                                                                   monkeypatch) -> None:
    fetched: list[int] = []
    credits: list[int] = []
    get_elements = tasks.TaskManager.get_elements

    def counting_get(self, *args, **kwargs):
        taken = get_elements(self, *args, **kwargs)
        if taken.elements:
            fetched.append(len(taken.elements))
        return taken

    monkeypatch.setattr(tasks.TaskManager, "get_elements", counting_get)
    cluster = cluster_factory(num_workers=1, num_processes=1)
    pool = cluster.workers[0]._tasks._executors  # noqa: SLF001 (introspection)
    send = pool.send

    def counting_send(slot, message):
        if isinstance(message, Credit):
            credits.append(message.n)
        send(slot, message)

    monkeypatch.setattr(pool, "send", counting_send)
    n = 600
    dataset = tds.Pipeline.range(n).map(slow).apply(
        tds.distribute("parallel_epochs", cluster.target))
    assert list(dataset) == list(range(n))
    assert len(fetched) <= n / 2, f"{len(fetched)} fetches for {n} elements"
    assert len(credits) <= n / flow.CREDIT_BATCH + 2, credits


@pytest.mark.timeout(60)
def test_credits_reach_a_blocked_replica_however_large_the_batch(cluster_factory,
                                                                  monkeypatch) -> None:
    # Only the replicas' Blocked messages return credits: a read longer than the credits of
    # a replica (CREDITS_PER_REPLICA) finishes only if they work.
    monkeypatch.setattr(flow, "CREDIT_BATCH", 10**9)
    monkeypatch.setattr(flow, "CREDIT_BATCH_BYTES", 1 << 62)
    cluster = cluster_factory(num_workers=1, num_processes=2)
    n = 3 * tasks.CREDITS_PER_REPLICA
    dataset = tds.Pipeline.range(n).apply(tds.distribute("parallel_epochs", cluster.target))
    assert list(dataset) == list(range(n))


def _shell_with(payloads: list[bytes]) -> tasks.TaskShell:
    """A started task whose elements come steadily and whose buffer holds `payloads`."""
    state = WorkerTask(common_pb2.TaskDef(task_id=1), time.monotonic)
    state.handle(Started((0,)))
    for k in range(4):
        state.arrivals.note(time.monotonic() - (4 - k) * flow.LINGER_S / 4)
    for offset, payload in enumerate(payloads):
        state.handle(ElementsArrived([BufferedElement(payload, None, offset, 0)]))
    assert state.arrivals.steady()
    return tasks.TaskShell(state)


@pytest.mark.timeout(30)
def test_a_fetch_whose_bytes_are_buffered_does_not_linger(monkeypatch) -> None:
    # A big element (a batch of images) fills a reply alone: waiting for more elements only
    # delayed every reply by the whole linger (the buffer never holds `want` of them).
    monkeypatch.setattr(tasks, "LINGER_S", 2.0)
    shell = _shell_with([bytes(1000)])
    with shell.cond:
        started = time.monotonic()
        assert shell.wait_for_elements(16, 1000, wait_s=5.0)
        assert time.monotonic() - started < 1.0
        started = time.monotonic()  # fewer bytes than a reply: it lingers, as before
        assert shell.wait_for_elements(16, 1001, wait_s=5.0)
        assert time.monotonic() - started >= 2.0


@pytest.mark.timeout(30)
def test_a_lingering_fetch_wakes_once_a_reply_s_bytes_arrived(monkeypatch) -> None:
    monkeypatch.setattr(tasks, "LINGER_S", 5.0)
    shell = _shell_with([bytes(600)])

    def arrive() -> None:
        time.sleep(0.3)
        with shell.cond:
            shell.wake(shell.state.handle(ElementsArrived([BufferedElement(
                bytes(600), None, 1, 0)])))

    thread = threading.Thread(target=arrive)
    with shell.cond:
        thread.start()
        started = time.monotonic()
        assert shell.wait_for_elements(16, 1000, wait_s=10.0)
        assert 0.2 < time.monotonic() - started < 3.0
    thread.join()

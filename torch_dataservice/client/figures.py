"""What a reader counts and says about itself: its stats (observability/client.py), the load
its heartbeats carry (the dispatcher's status and optimal-workers estimate), and what a long
wait waits for (observability/waiting.py)."""

from __future__ import annotations

import time

import grpc

from torch_dataservice.client import transports
from torch_dataservice.client.membership import Membership
from torch_dataservice.observability.client import ClientStats, current_sink
from torch_dataservice.observability.waiting import Waiting, WaitReport
from torch_dataservice.policies import TargetWorkers
from torch_dataservice.proto import status_pb2


class ReaderFigures:
    def __init__(self, dispatcher_address: str, stats: ClientStats | None) -> None:
        # A DataLoader reading on this thread made its own stats the sink and counts batches
        # and waiting itself; otherwise this reader does.
        sink = current_sink()
        self.stats = sink or stats or ClientStats()
        self.counts_consumer = sink is None
        self.elements = self.bytes = 0  # this reader's share of its iteration
        self.blocked_since: float | None = None  # the consumer's __next__ is blocked
        self._address = dispatcher_address
        self._wait_report = WaitReport()
        self._reported_wait = 0.0

    def received(self, worker_address: str, elements: int, nbytes: int) -> None:
        self.elements += elements
        self.bytes += nbytes
        self.stats.received(worker_address, elements, nbytes)

    def took(self) -> None:
        if self.counts_consumer:
            self.stats.batches += 1

    def waited(self, since: float | None) -> None:
        """`__next__` returned; it had blocked since `since` (perf_counter), if at all."""
        self.blocked_since = None
        if since is not None and self.counts_consumer:
            self.stats.wait_seconds += time.perf_counter() - since

    def load(self) -> status_pb2.ClientLoad:
        """What the dispatcher's status and optimal-workers estimate need from this reader."""
        stats, blocked = self.stats, self.blocked_since
        waiting = time.monotonic() - blocked if blocked and self.counts_consumer else 0.0
        # The wait under way counts too; a total never goes down (a restart would, to 0).
        self._reported_wait = max(self._reported_wait, stats.wait_seconds + waiting)
        return status_pb2.ClientLoad(rank=max(0, stats.rank), batches=stats.batches,
                                     wait_seconds=self._reported_wait,
                                     elements=self.elements, bytes=self.bytes)

    def report_wait(self, membership: Membership, target_workers: TargetWorkers) -> None:
        """After a heartbeat: say what a long wait waits for, when it is due."""
        blocked, now = self.blocked_since, time.monotonic()
        if self._wait_report.due(blocked, now) and blocked is not None:
            self._wait_report.report(self._waiting(membership, target_workers), now - blocked,
                                     not self.elements)

    def _waiting(self, membership: Membership, target_workers: TargetWorkers) -> Waiting:
        now = time.monotonic()
        down = membership.down_since
        waiting = Waiting(self._address, membership.iteration_id,
                          dispatcher_down_s=now - down if down is not None else 0.0)
        with membership.lock:
            states = [s for s in membership.tasks.values() if not s.ended]
        for state in states:
            target = transports.data_target(state.info, target_workers) or ("grpc",)
            via = ":".join(str(part) for part in target)
            (waiting.unreachable if state.failures else waiting.serving).append(
                f"worker {state.info.worker_address}" + (f" (via {via})" if state.failures
                                                         else ""))
        if not states and not down:
            from torch_dataservice.observability.status_text import fetch_status

            try:
                waiting.workers_registered = len(fetch_status(self._address, 2.0).workers)
            except grpc.RpcError:
                pass
        return waiting

"""The consumer's side of coordinated rounds (client/rounds.py), without servers: a consumer
whose buffer is full still tells the dispatcher where it will stop on a lost task."""

from __future__ import annotations

import threading
import time

from torch_dataservice.client.membership import TaskState
from torch_dataservice.client.rounds import CoordinatedRounds
from torch_dataservice.proto import common_pb2, dispatcher_pb2


class FakeMembership:
    """What CoordinatedRounds uses of a Membership."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.closed = threading.Event()
        self.tasks: dict[int, TaskState] = {}
        self.fatal: BaseException | None = None

    def heartbeat(self) -> bool:
        return True

    def fail(self, error: BaseException) -> None:
        self.fatal = error


def test_a_consumer_with_a_full_buffer_reports_the_lost_round_it_will_stop_at() -> None:
    membership = FakeMembership()
    slots = threading.BoundedSemaphore(1)
    slots.acquire()  # its application holds the one batch it may buffer (waits elsewhere)
    rounds = CoordinatedRounds(0, membership, lambda state, r: None, slots,  # type: ignore[arg-type]
                               lambda: None, lambda batch: None, connect_timeout_s=30)
    reply = dispatcher_pb2.ClientHeartbeatResponse()
    for task_id in (7, 8):  # round r falls on task (7, 8)[r % 2]; task 8's worker was lost
        reply.tasks.add(task_id=task_id, lost=task_id == 8)
    with membership.lock:
        membership.tasks = {t.task_id: TaskState(common_pb2.TaskInfo(task_id=t.task_id))
                            for t in reply.tasks}
        rounds.apply(reply, membership.tasks)
    thread = threading.Thread(target=rounds.run, daemon=True)
    thread.start()
    try:
        request = dispatcher_pb2.ClientHeartbeatRequest()
        deadline = time.monotonic() + 10
        while not request.HasField("blocked_round") and time.monotonic() < deadline:
            time.sleep(0.05)
            request = dispatcher_pb2.ClientHeartbeatRequest()
            with membership.lock:
                rounds.fill(request)
        # Waiting for a slot at round 0 (task 7), it promises to stop at round 1 (task 8).
        assert request.HasField("blocked_round"), "the consumer never said where it stops"
        assert (request.blocked_round, request.removals_seen) == (1, 0)
    finally:
        membership.closed.set()
        thread.join(5)

"""Coordinated reads (`consumer_index` / `num_consumers`): one consumer's side of the rounds.

One fetch thread asks for round r, r+1, ... in order from task `active[r % len(active)]`,
where `active` is the iteration's task set sorted by id, the same for every consumer at every
round:
  - a task at its end leaves at the same round for everyone (its worker answers
    end_of_sequence for that round to all of them); the read ends when no task is left;
  - a task whose worker was lost leaves at a round the dispatcher picks once every consumer is
    stopped on lost tasks (dispatcher/coordinated.py `note_blocked`); rounds before it that
    fall on the lost task are skipped;
  - a worker that joins (new, or restarted) gets a task that joins at a round every consumer
    promised not to have read (`plan_addition`): a consumer that reaches a proposed round
    waits there until the dispatcher decided.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from torch_dataservice.client.delivery import Batch
from torch_dataservice.client.membership import Membership, TaskState
from torch_dataservice.proto import dispatcher_pb2

DONE_REPORT_S = 5.0  # how long a consumer tries to say it read its last round
WAIT_POLL_S = 0.05
LOST = Batch()  # a fetch's answer when the task's worker was lost

Fetch = Callable[[TaskState, int], "Batch | None"]  # one try at a task's round
SKIPPED = -1  # Cursor.advance: the round falls on a lost task that leaves later
LOOKAHEAD_ROUNDS = 1024  # how far a consumer looks for its next round on a lost task


class Cursor:
    """The task set a consumer reads at each round: removals and additions applied in
    order, as every consumer applies them."""

    def __init__(self, active: list[int], applied: int = 0,
                 joined: set[int] | None = None) -> None:
        self.active = active  # sorted task ids
        self.applied = applied  # removals applied
        self.joined = joined or set()  # tasks that joined at their starting round

    def copy(self) -> Cursor:
        return Cursor(list(self.active), self.applied, set(self.joined))

    def advance(self, round_index: int, removals: list[tuple[int, frozenset[int]]],
                additions: list[tuple[int, int]]) -> tuple[int | None, bool]:
        """(the task of `round_index`, SKIPPED or None at the end; whether this round
        applied a removal)."""
        removed = self.applied < len(removals) and removals[self.applied][0] <= round_index
        while self.applied < len(removals) and removals[self.applied][0] <= round_index:
            self.active = [t for t in self.active if t not in removals[self.applied][1]]
            self.applied += 1
        new = [t for start, t in additions if start <= round_index and t not in self.joined]
        if new:
            self.joined.update(new)
            self.active = sorted(self.active + new)
        if not self.active:
            return None, removed
        task_id = self.active[round_index % len(self.active)]
        if any(task_id in tasks for _, tasks in removals[self.applied:]):
            return SKIPPED, removed
        return task_id, removed


class CoordinatedRounds:
    """The rounds protocol; state guarded by the membership's lock."""

    def __init__(self, consumer_index: int, membership: Membership, fetch: Fetch,
                 slots: threading.BoundedSemaphore, begin_fetch: Callable[[], None],
                 end_fetch: Callable[[Batch | None], None], connect_timeout_s: float) -> None:
        self._consumer = consumer_index
        self._membership = membership
        self._fetch = fetch
        self._slots = slots
        self._begin_fetch = begin_fetch  # a fetch starts (the reader counts those in flight) ...
        self._end_fetch = end_fetch  # ... and ends: its batch is queued, or its slot given back
        self._timeout_s = connect_timeout_s
        self.finished = False
        self._initial: list[int] | None = None  # the tasks it started with, sorted
        self._lost: set[int] = set()
        self._removals: list[tuple[int, frozenset[int]]] = []  # (round, task ids), in order
        self._blocked_round: int | None = None  # stopped at, on a lost task (or done)
        self._done = False  # read its last round (reported with _blocked_round)
        # (round, removals seen): it stops at that round, on a lost task, until the next
        # removal is decided (_promise_lost_round); reported as blocked there meanwhile.
        self._promise: tuple[int, int] | None = None
        self._looked_in_vain: tuple | None = None  # (_promise_lost_round)
        self._current_round = 0  # the round it reads or will read next
        self._ready_round: int | None = None  # a proposed addition round it waits at
        self._waiting_since: float | None = None

    # ------------------------------------------------------------------ heartbeats
    def fill(self, request: dispatcher_pb2.ClientHeartbeatRequest) -> None:
        request.consumer_index = self._consumer
        if self._blocked_round is not None:
            request.blocked_round = self._blocked_round
            request.removals_seen = len(self._removals)
            request.consumer_done = self._done
        elif self._promised() is not None:
            request.blocked_round, request.removals_seen = self._promise  # type: ignore[misc]
        request.current_round = self._current_round
        if self._ready_round is not None:
            request.ready_round = self._ready_round

    def apply(self, response: dispatcher_pb2.ClientHeartbeatResponse,
              tasks: dict[int, TaskState]) -> None:
        self._lost = {info.task_id for info in response.tasks if info.lost}
        if len(response.removals) > len(self._removals):
            self._removals = [(r.round, frozenset(r.task_ids)) for r in response.removals]
        # Promise to wait at a proposed addition round, unless already past it (the
        # dispatcher then proposes a later one).
        if not response.HasField("addition_round"):
            self._ready_round = None  # decided (the tasks are listed) or withdrawn
        elif response.addition_round != self._ready_round:
            proposal = response.addition_round
            self._ready_round = proposal if self._current_round < proposal else None
        if self._initial is None and tasks:  # later tasks join at their starting round
            self._initial = sorted(t for t, s in tasks.items() if s.info.starting_round == 0)

    # ------------------------------------------------------------------ the rounds thread
    def run(self) -> None:
        """Read rounds in order until the end, a failure or close."""
        round_index, cursor = 0, None
        while not self._membership.closed.is_set():
            if cursor is None:
                initial = self._initial_tasks()
                cursor = None if initial is None else Cursor(initial)
                continue
            plan = self._plan(round_index)
            if plan is None:
                if self._membership.fatal is not None:
                    return
                continue  # waiting at a proposed round for the outcome
            removals, additions = plan
            task_id, removed = cursor.advance(round_index, removals, additions)
            if task_id is None:
                self._end(removed, round_index)
                return
            if task_id == SKIPPED:
                round_index += 1  # the lost task's round: skipped by all who had not read it
                continue
            self._promise_lost_round(cursor, round_index, removals, additions)
            promised = self._promised()
            if promised is not None and round_index >= promised and task_id not in self._lost:
                # Past the round it promised to stop at (the plan changed since: a task
                # ended): wait there for the removal all consumers now agree on.
                if not self._wait_for_next_removal(round_index, len(removals)):
                    return
                continue
            step = self._read(task_id, round_index, cursor.applied)
            if step is None:
                return
            if step == "ended":  # the same round goes to the next task, for everyone
                cursor.active.remove(task_id)
            elif step == "read":
                round_index += 1

    def _promised(self) -> int | None:
        """The round it promised to stop at, until a removal is decided after the promise."""
        promise = self._promise
        return promise[0] if promise is not None and promise[1] == len(self._removals) else None

    def _promise_lost_round(self, cursor: Cursor, round_index: int, removals: list,
                            additions: list) -> None:
        """While a lost task awaits its removal, report now the first round this consumer
        would stop at on it, and stop there whatever happens: the removal needs every
        consumer stopped, and a consumer whose buffer is full (its application waits on
        another consumer, as a reader that zips them does) would otherwise never get there."""
        with self._membership.lock:
            removed = {t for _, tasks in removals for t in tasks}
            pending = self._lost - removed
            if not pending or self._promised() is not None:
                return
            # A lost task this consumer no longer reads (it ended here) is never reached: not
            # looked for again until something changes.
            looked = (len(removals), frozenset(pending), tuple(cursor.active), len(additions))
            if looked == self._looked_in_vain:
                return
            ahead = cursor.copy()
            for r in range(round_index, round_index + LOOKAHEAD_ROUNDS):
                task_id, _ = ahead.advance(r, removals, additions)
                if task_id is None:
                    break
                if task_id in pending:
                    self._promise = (r, len(removals))
                    return
            self._looked_in_vain = looked

    def _initial_tasks(self) -> list[int] | None:
        with self._membership.lock:
            if self._initial is None:
                self._membership.lock.wait(WAIT_POLL_S)
                return None
            return list(self._initial)

    def _read(self, task_id: int, round_index: int, applied: int) -> str | None:
        """Read this consumer's element of `round_index` from `task_id`: "read", "ended",
        "retry" (a removal was decided; plan again) or None (stop)."""
        if not self._slots.acquire(timeout=0.2):
            return "retry"
        state = self._membership.tasks[task_id]
        self._begin_fetch()
        batch: Batch | None = None
        try:
            batch = self._fetch_round(state, round_index)
        finally:
            self._end_fetch(None if batch is LOST else batch)
        if batch is LOST:
            return "retry" if self._wait_for_removal(
                round_index, lambda: any(task_id in tasks for _, tasks in self._removals[applied:]),
                f"the worker of task {task_id}") else None
        if batch is None or batch.error is not None:
            return None  # closed or failed (fatal is set), or the error is queued
        return "read" if batch.payloads else "ended"

    def _end(self, removed: bool, round_index: int) -> None:
        if removed:
            self._membership.fail(
                RuntimeError("coordinated reads: every worker of the job was lost"))
            return
        with self._membership.lock:
            # Tell the dispatcher where we ended, for good: a consumer still stopped on a lost
            # task must not wait for this one (see _wait_for_removal).
            self._blocked_round, self._done = round_index, True
        deadline = time.monotonic() + DONE_REPORT_S
        while not self._membership.heartbeat() and time.monotonic() < deadline \
                and self._membership.fatal is None and not self._membership.closed.wait(0.2):
            pass
        with self._membership.lock:
            self.finished = True
            self._membership.lock.notify_all()

    def _plan(self, round_index: int) -> tuple[list, list] | None:
        """The removals and additions known, once `round_index` may be read; None while
        this consumer waits at a proposed addition round (a bounded wait)."""
        with self._membership.lock:
            if self._ready_round is not None and round_index >= self._ready_round:
                if self._waiting_since is None:
                    self._waiting_since = time.monotonic()
                elif time.monotonic() - self._waiting_since > self._timeout_s:
                    self._membership.fatal = RuntimeError(
                        f"coordinated read of round {round_index}: workers were to join at "
                        f"round {self._ready_round}, and not every consumer of the job agreed "
                        f"within {self._timeout_s:.0f}s (is every consumer reading?)")
                    self._membership.lock.notify_all()
                    return None
                self._membership.lock.wait(WAIT_POLL_S)
                return None
            self._waiting_since = None
            self._current_round = round_index
            additions = sorted((s.info.starting_round, t) for t, s in self._membership.tasks.items()
                               if s.info.starting_round > 0)
            return list(self._removals), additions

    def _wait_for_next_removal(self, round_index: int, seen: int) -> bool:
        return self._wait_for_removal(round_index, lambda: len(self._removals) > seen,
                                      "a lost worker")

    def _wait_for_removal(self, round_index: int, decided: Callable[[], bool],
                          lost: str) -> bool:
        """Stopped at `round_index` on a lost task: wait until the dispatcher decides when it
        leaves (once every consumer is stopped on lost tasks), `decided()` with the lock held.
        False if closed or failed."""
        deadline = time.monotonic() + self._timeout_s
        with self._membership.lock:
            self._blocked_round = round_index
        try:
            self._membership.heartbeat()  # report now rather than at the next beat
            with self._membership.lock:
                while not decided():
                    if self._membership.closed.is_set() or self._membership.fatal is not None:
                        return False
                    if time.monotonic() > deadline:
                        self._membership.fatal = RuntimeError(
                            f"coordinated read of round {round_index}: {lost} was lost, and "
                            f"within {self._timeout_s:.0f}s neither "
                            "did every consumer of the job reach a lost worker's round (is "
                            "every consumer still reading?) nor did a worker take its place")
                        self._membership.lock.notify_all()
                        return False
                    self._membership.lock.wait(0.1)
            return True
        finally:
            with self._membership.lock:
                self._blocked_round = None

    def _fetch_round(self, state: TaskState, round_index: int) -> Batch | None:
        """This consumer's element of `round_index` from `state`'s task (empty batch: its end)."""
        failing_since: float | None = None
        while not self._membership.closed.is_set():
            if state.info.task_id in self._lost:
                return LOST
            now = time.monotonic()
            if state.retry_at > now:
                self._membership.closed.wait(state.retry_at - now)
                continue
            try:
                batch = self._fetch(state, round_index)
            except Exception as error:  # raised by an in-process worker
                self._membership.fail(error)
                return None
            if self._membership.fatal is not None:
                return None
            if batch is None:  # worker unreachable: keep trying, but not forever
                failing_since = failing_since or now
                if now - failing_since > self._timeout_s:
                    self._membership.fail(RuntimeError(
                        f"coordinated read of round {round_index}: worker "
                        f"{state.info.worker_address} unreachable for "
                        f"{now - failing_since:.0f}s; coordinated reads cannot continue "
                        "without one of their workers"))
                    return None
                continue
            failing_since = None
            if batch.payloads or batch.error is not None or state.ended:
                return batch
        return None

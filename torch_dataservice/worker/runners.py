"""Task runners: who gets which element of a task (tf.data service's TaskRunner).

Every runner answers one `get(request, wait_s) -> Taken` for a GetElements request, and
`make_runner` picks the runner of a task from its definition, as tf.data's
`TaskRunner::Create(task_def)` does. All of them sit on a task's first-come-first-served buffer,
reached through `take(max_elements, max_bytes, wait_s) -> Taken` (TaskManager.get_elements), so
credits and back-pressure work as for any task.

- `FirstComeFirstServedRunner` (the default): each request gets what the buffer holds.
- `RoundRobinRunner` (coordinated reads, `num_consumers`): round r of this task is the next
  `num_consumers` elements of its buffer, and consumer i receives the i-th. A round is formed by
  the first request for it (the order of first requests is the round order, since every
  consumer asks for rounds in increasing order) and kept until every consumer took its element.
  Only complete rounds are served: when the input ends with fewer than `num_consumers` elements
  left, those are dropped and every request for that round or a later one gets end of sequence,
  so all consumers stop at the same round boundary.
- `CachingRunner` (cross-trainer cache): the pipeline is computed once into a sliding window of
  elements bounded in bytes; every trainer id has its own absolute position in the stream and
  never reads an element twice; eviction from the front moves slow trainers forward. The input
  must be infinite, as in tf.data service.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, NamedTuple, Protocol

from torch_dataservice.proto import common_pb2, worker_pb2
from torch_dataservice.worker.messages import TaskError


class Taken(NamedTuple):
    """What a fetch gets: elements (with .payload, .split, .offset), end of sequence, error."""

    elements: list[Any]
    end_of_sequence: bool
    error: TaskError | None


class Take(Protocol):
    """Up to `max_elements` (about `max_bytes`) elements, waiting up to `wait_s` for one."""

    def __call__(self, max_elements: int, max_bytes: int, *, wait_s: float) -> Taken: ...

DEFAULT_MAX_BYTES = 64 << 20  # a request that names no byte limit


class TaskRunner(Protocol):
    def get(self, request: worker_pb2.GetElementsRequest, wait_s: float) -> Taken:
        """The elements for one GetElements request; waits up to `wait_s` for one."""
        ...

    @property
    def dropped_at_end(self) -> int:
        """Elements of the task no consumer will receive (an incomplete last round)."""
        ...


def limits(request: worker_pb2.GetElementsRequest) -> tuple[int, int]:
    """(max elements, max bytes) of a request, with the defaults of a request naming none."""
    return max(1, request.max_elements or 1), request.max_bytes or DEFAULT_MAX_BYTES


def make_runner(definition: common_pb2.TaskDef, take: Take, take_encoded: Take, *,
                cache_bytes: int) -> TaskRunner:
    """The runner of a task: `take_encoded` (elements as bytes) feeds the cache, which serves an
    element to several trainers that must not share one object."""
    if definition.HasField("num_consumers"):
        return RoundRobinRunner(definition.num_consumers, take)
    if definition.cross_trainer_cache:
        return CachingRunner(cache_bytes, take_encoded)
    return FirstComeFirstServedRunner(take)


class FirstComeFirstServedRunner:
    """Whoever asks first gets the buffer's next elements."""

    dropped_at_end = 0

    def __init__(self, take: Take) -> None:
        self._take = take

    def get(self, request: worker_pb2.GetElementsRequest, wait_s: float) -> Taken:
        return self._take(*limits(request), wait_s=wait_s)


# Rounds formed but not yet taken by every consumer: a consumer this far ahead of the slowest
# one waits, which bounds the worker's memory by this many rounds of elements.
MAX_HELD_ROUNDS = 4
_UNBOUNDED_BYTES = 1 << 62

CACHE_FINITE_INPUT_MESSAGE = (
    "Cross-trainer caching requires the input dataset to be infinite. However, it reached the "
    "end of sequence. Apply .repeat() to the pipeline before distributing it."
)


class RoundAlreadyServedError(ValueError):
    """A consumer asked for a round every consumer already took (a duplicated request)."""


class RoundRobinRunner:
    """Strict round robin over `num_consumers` consumers for one task."""

    def __init__(self, num_consumers: int, take: Take) -> None:
        self._num_consumers = num_consumers
        self._take = take
        self._cond = threading.Condition()
        self._rounds: dict[int, list[Any]] = {}
        self._taken: dict[int, set[int]] = {}
        self._last_round = -1      # latest round formed (or found to be the end)
        self._pending: list[Any] = []  # elements taken from the buffer, not yet in a round
        self._filling = False
        self._end_round: int | None = None
        self._error: TaskError | None = None
        self._error_round: int | None = None
        self.dropped_at_end = 0  # elements of the incomplete last round

    def get(self, request: worker_pb2.GetElementsRequest, wait_s: float) -> Taken:
        if not request.HasField("consumer_index") or not request.HasField("round_index"):
            raise ValueError(
                f"task {request.task_id} serves coordinated reads: a request needs "
                "consumer_index and round_index")
        return self.get_round(request.consumer_index, request.round_index, wait_s)

    def get_round(self, consumer_index: int, round_index: int, wait_s: float) -> Taken:
        """Consumer `consumer_index`'s element of round `round_index`.

        Returns ([element], False, None), ([], True, None) at the end, ([], False, error) when
        the pipeline failed, or ([], False, None) when the round is not ready within `wait_s`
        (the client asks again).
        """
        if not 0 <= consumer_index < self._num_consumers:
            raise ValueError(
                f"consumer_index must be in [0, {self._num_consumers}), got {consumer_index}")
        if round_index < 0:
            raise ValueError(f"round_index must be >= 0, got {round_index}")
        deadline = time.monotonic() + wait_s
        filled = False
        while True:
            with self._cond:
                while True:
                    held = self._rounds.get(round_index)
                    if held is not None:
                        return Taken([self._hand_out(round_index, consumer_index, held)],
                                     False, None)
                    if self._end_round is not None and round_index >= self._end_round:
                        return Taken([], True, None)
                    if self._error_round is not None and round_index >= self._error_round:
                        return Taken([], False, self._error)
                    if round_index <= self._last_round:
                        raise RoundAlreadyServedError(
                            f"round {round_index} was already taken by every consumer (the "
                            f"current round of this task is past it, at {self._last_round}); "
                            f"consumer {consumer_index} asked for it again")
                    remaining = deadline - time.monotonic()
                    if (not self._filling and len(self._rounds) < MAX_HELD_ROUNDS
                            and (remaining > 0 or not filled)):
                        break
                    if remaining <= 0:
                        return Taken([], False, None)
                    self._cond.wait(remaining)
                self._filling = True
                need = self._num_consumers - len(self._pending)
            self._fill(round_index, need, max(0.0, deadline - time.monotonic()))
            filled = True

    def _hand_out(self, round_index: int, consumer_index: int, held: list[Any]) -> Any:
        taken = self._taken[round_index]
        taken.add(consumer_index)  # a repeated request (lost reply) gets the same element
        if len(taken) == self._num_consumers:
            del self._rounds[round_index]
            del self._taken[round_index]
            self._cond.notify_all()
        return held[consumer_index]

    def _fill(self, round_index: int, need: int, wait_s: float) -> None:
        elements: list[Any] = []
        end, error = False, None
        try:
            elements, end, error = self._take(need, _UNBOUNDED_BYTES, wait_s=wait_s)
        finally:
            with self._cond:
                self._filling = False
                self._pending.extend(elements)
                n = self._num_consumers
                if len(self._pending) >= n:
                    self._rounds[round_index] = self._pending[:n]
                    self._taken[round_index] = set()
                    self._pending = self._pending[n:]
                    self._last_round = round_index
                elif error is not None:
                    self._error, self._error_round = error, round_index
                    self._last_round = round_index
                elif end:
                    # An incomplete last round is dropped for everyone: every consumer then
                    # has received the same number of elements.
                    self._end_round = round_index
                    self._last_round = round_index
                    self.dropped_at_end = len(self._pending)
                    self._pending.clear()
                self._cond.notify_all()


class CachingRunner:
    """A byte-bounded sliding window of one task's elements, shared by trainer ids."""

    dropped_at_end = 0  # an infinite input: no end

    def __init__(self, max_bytes: int, take: Take) -> None:
        self._max_bytes = max_bytes
        self._take = take
        self._cond = threading.Condition()
        self._window: deque[Any] = deque()
        self._start = 0            # absolute index of window[0]
        self._bytes = 0
        self._positions: dict[str, int] = {}  # trainer id -> absolute index of its next element
        self._extending = False
        self._error: TaskError | None = None

    def get(self, request: worker_pb2.GetElementsRequest, wait_s: float) -> Taken:
        return self.get_for(request.trainer_id, *limits(request), wait_s=wait_s)

    def get_for(self, trainer_id: str, max_elements: int, max_bytes: int, *,
                wait_s: float) -> Taken:
        """The next elements for `trainer_id`: from the window, or newly produced."""
        if not trainer_id:
            raise ValueError("a read with a cross-trainer cache needs a non-empty trainer_id")
        deadline = time.monotonic() + wait_s
        extended = False
        while True:
            with self._cond:
                while True:
                    served = self._serve(trainer_id, max_elements, max_bytes)
                    if served:
                        return Taken(served, False, None)
                    if self._error is not None:
                        return Taken([], False, self._error)
                    remaining = deadline - time.monotonic()
                    if not self._extending and (remaining > 0 or not extended):
                        break
                    if remaining <= 0:
                        return Taken([], False, None)
                    self._cond.wait(remaining)
                self._extending = True
            # At most a window's worth: what is produced is never evicted by the same extension.
            self._extend(max_elements, min(max_bytes, self._max_bytes),
                         max(0.0, deadline - time.monotonic()))
            extended = True

    def _serve(self, trainer_id: str, max_elements: int, max_bytes: int) -> list[Any]:
        # A new trainer starts at the oldest element still cached; one that fell behind the
        # window jumps to its front (what eviction means for a slow trainer).
        position = max(self._positions.get(trainer_id, self._start), self._start)
        offset = position - self._start
        served: list[Any] = []
        size = 0
        while offset + len(served) < len(self._window) and len(served) < max_elements and (
                not served or size < max_bytes):
            element = self._window[offset + len(served)]
            served.append(element)
            size += len(element.payload)
        self._positions[trainer_id] = position + len(served)
        return served

    def _extend(self, max_elements: int, max_bytes: int, wait_s: float) -> None:
        elements: list[Any] = []
        end, error = False, None
        try:
            elements, end, error = self._take(max_elements, max_bytes, wait_s=wait_s)
        finally:
            with self._cond:
                self._extending = False
                for element in elements:
                    self._window.append(element)
                    self._bytes += len(element.payload)
                # Evict from the front, but never what was just produced: the trainer that
                # extended the window has not read it yet.
                while self._bytes > self._max_bytes and len(self._window) > len(elements):
                    self._bytes -= len(self._window.popleft().payload)
                    self._start += 1
                if error is not None:
                    self._error = error
                elif end:
                    self._error = TaskError("ValueError", CACHE_FINITE_INPUT_MESSAGE, "")
                self._cond.notify_all()

    @property
    def window(self) -> tuple[int, int, int]:
        """(absolute index of the oldest cached element, number of elements, bytes)."""
        with self._cond:
            return self._start, len(self._window), self._bytes

"""How often workers and readers report, and when the dispatcher refuses: sized to the fleet.

Workers heartbeat every 500 ms and readers every 100 ms by default, so a small fleet reacts
fast (tf.data service: workers 30 s, readers 1 s). A big fleet at those rates would take more
than a core of the dispatcher, so the dispatcher stretches both intervals by one factor until
the fleet's heartbeat rate fits `heartbeat_budget_rps`, and further while it refuses requests,
and tells each peer its interval in every reply. Stretching is capped and the liveness
timeouts grow with it (LIVENESS_BEATS intervals). The caps come from failure detection: a
dead worker is noticed within 4 x MAX_WORKER_INTERVAL_S = 20 s, and its splits are handed
again once every reader has reported since (requeue_ready, dispatcher/splits.py), within
MAX_CLIENT_INTERVAL_S more: 30 s at any size. A reader's own at-least-once window is one of
its intervals (what it took since its last acknowledgement is read again if it dies), and it
is taken for dead after LIVENESS_BEATS of them (40 s at the cap). Past its capacity (too
many requests in its handlers at once) the dispatcher refuses with RESOURCE_EXHAUSTED and
a retry-after: heartbeats first, GetSplit only well past it, so heartbeats are stretched
before splits are delayed. Capacity is measured two ways: requests in the handlers at
once, and how long a request waited behind others for a handler thread (QueuedExecutor):
one that waited past MAX_QUEUED_S is refused at once, so the latency of the requests served
stays bounded however many arrive. (A request that found a handler idle, at a dispatcher
using little CPU, is never refused for its wait: that was a busy host not scheduling the
dispatcher, not a backlog of its own.)
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from typing import Any

import grpc

from torch_dataservice.errors import RETRY_AFTER_KEY
from torch_dataservice.proto import status_pb2

WORKER_DEFAULT_S = 0.5  # WorkerConfig.effective_heartbeat_interval_ms
CLIENT_DEFAULT_S = 0.1  # client/membership.py HEARTBEAT_INTERVAL_S
MAX_WORKER_INTERVAL_S = 5.0  # however big the fleet (see the module docstring)
MAX_CLIENT_INTERVAL_S = 10.0
LIVENESS_BEATS = 4  # a peer is silent after this many missed intervals (or the timeout)
MAX_LOAD_STRETCH = 8.0
# Past the heartbeat budget, the workers' GetSplit asks are kept near this share of it: each
# stock is told to cover more of its work, so it asks for more splits at a time.
SPLIT_ASK_SHARE = 0.5
# The most work a stock is told to cover: how long the tail of an epoch may be, when the last
# splits wait in one worker's stock while others have none.
MAX_SPLIT_COVER_S = 10.0
REFUSED_SHARE = 0.01  # refusing more than this share of requests stretches the intervals
SPLIT_RETRY_AFTER_S = 0.2
# A request that waited this long for a handler thread is refused (heartbeats at half of it).
MAX_QUEUED_S = 0.1
# A dispatcher using this share of a core is busy: its waits for a handler are its own.
BUSY_CORES = 0.5
# The RPCs refused first (at half the capacity): what a stretched interval makes up for.
HEARTBEATS = frozenset({"ClientHeartbeat", "WorkerHeartbeat"})
# Refused at full capacity; every other RPC (registration, release, status) is always served.
SHEDDABLE = HEARTBEATS | {"GetSplit", "GetOrCreateIteration"}


def population_stretch(workers: int, clients: int, budget_rps: float) -> float:
    """The least factor >= 1 by which stretching both default intervals keeps the fleet's
    heartbeat rate within `budget_rps` (the largest useful one when the caps forbid it)."""

    def rate(stretch: float) -> float:
        return (workers / min(WORKER_DEFAULT_S * stretch, MAX_WORKER_INTERVAL_S)
                + clients / min(CLIENT_DEFAULT_S * stretch, MAX_CLIENT_INTERVAL_S))

    if rate(1.0) <= budget_rps:
        return 1.0
    low, high = 1.0, max(MAX_WORKER_INTERVAL_S / WORKER_DEFAULT_S,
                         MAX_CLIENT_INTERVAL_S / CLIENT_DEFAULT_S)
    if rate(high) > budget_rps:
        return high
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (low, middle) if rate(middle) <= budget_rps else (middle, high)
    return high


def split_cover_ms(workers: int, budget_rps: float, stretch: float, load: float) -> int:
    """How much of its replicas' work a worker's split stock should cover: 0 (the worker's
    own rule, worker/split_budget.py) while the fleet fits the budget; past it, enough that
    the workers' GetSplit asks stay near SPLIT_ASK_SHARE of the budget (a stock refilled at
    half its target asks once per half of its cover), longer while the dispatcher refuses."""
    if stretch <= 1.0:
        return 0
    cover_s = 2 * workers / (SPLIT_ASK_SHARE * budget_rps) * load
    return round(1000 * min(MAX_SPLIT_COVER_S, cover_s))


def interval_ms(default_s: float, stretch: float, cap_s: float) -> int:
    """What a reply asks for: 0 (the peer's own default) unless stretched."""
    if stretch <= 1.0:
        return 0
    return round(min(default_s * stretch, cap_s) * 1000)


@dataclass
class _Peak:
    """The longest interval asked lately: a peer told it may stay silent that long."""

    interval_s: float = 0.0
    until: float = 0.0

    def note(self, interval_s: float, now: float) -> None:
        if interval_s >= self.interval_s or now > self.until:
            self.interval_s = interval_s
        if interval_s == self.interval_s:
            self.until = now + interval_s


class Cadence:
    """The intervals in force and the admission of requests (thread-safe, cheap per RPC)."""

    def __init__(self, budget_rps: float, max_pending: int) -> None:
        """DispatcherConfig.heartbeat_budget_rps and max_pending_rpcs (the dispatcher has
        8 handler threads, dispatcher/server.py: past them, the wait for one is the bound)."""
        self.budget_rps, self.max_pending = budget_rps, max_pending
        self._lock = threading.Lock()
        self.pending = 0
        self.population = 1.0  # stretch for the population
        self.load = 1.0  # stretch for the dispatcher's own load
        self.worker_ms = self.client_ms = 0
        self.split_cover_ms = 0  # what GetSplit replies tell the workers' stocks
        self._peaks = {"worker": _Peak(), "client": _Peak()}
        self.answered = self.refused = 0  # counters since start
        # Peers whose heartbeat was refused, and when: refused is not silent (liveness).
        self._refused_beats: dict[tuple[str, Any], float] = {}
        self.cores = self.rpcs_per_s = self.refused_per_s = 0.0
        self._last = (time.monotonic(), time.process_time(), 0, 0)

    @property
    def stretch(self) -> float:
        return self.population * self.load

    # ------------------------------------------------------------------ per request
    @staticmethod
    def queued_at() -> float | None:
        """When the request this thread handles was queued for a handler thread
        (time.monotonic; None outside a QueuedExecutor)."""
        return getattr(_queued, "at", None)

    def admit(self, method: str, queued_s: float = 0.0, behind: bool = True) -> float | None:
        """Count a request in; None if admitted (call `done` after), else the retry-after (s).
        `queued_s`: how long it waited for a handler thread; `behind`: whether it waited
        behind other requests (no handler thread was idle when it came)."""
        # A wait is overload when the request queued behind others, or when this process is
        # busy (its handler threads then wait for the GIL, not in the queue). Otherwise it was
        # the host not scheduling an idle dispatcher: refusing would not mend that, and a
        # small fleet's failure detection must not stretch for it.
        overdue = (behind or self.cores >= BUSY_CORES) and queued_s > (
            MAX_QUEUED_S / 2 if method in HEARTBEATS else MAX_QUEUED_S)
        with self._lock:
            heartbeat = method in HEARTBEATS
            limit = self.max_pending // 2 if heartbeat else self.max_pending
            if method in SHEDDABLE and (self.pending >= max(1, limit) or overdue):
                self.refused += 1
                if method == "WorkerHeartbeat":
                    return max(WORKER_DEFAULT_S, self.worker_ms / 1000)
                if method == "ClientHeartbeat":
                    return max(CLIENT_DEFAULT_S, self.client_ms / 1000)
                return SPLIT_RETRY_AFTER_S
            self.pending += 1
            return None

    def refused_beat(self, method: str, request: Any, now: float) -> None:
        """A heartbeat was refused: its sender is alive all the same."""
        key = (("worker", request.worker_address) if method == "WorkerHeartbeat"
               else ("client", request.client_id))
        with self._lock:
            self._refused_beats[key] = now

    def take_refused_beats(self) -> dict[tuple[str, Any], float]:
        """(kind, worker address or client id) -> when its last heartbeat was refused."""
        with self._lock:
            beats, self._refused_beats = self._refused_beats, {}
        return beats

    def done(self) -> None:
        with self._lock:
            self.pending -= 1
            self.answered += 1

    @contextlib.contextmanager
    def waiting_for_disk(self) -> Iterator[None]:
        """A request waiting for the journal's fsync uses no CPU and holds no lock: it is not
        counted as pending meanwhile. (Journaled, a handler thread spends much of its request
        in the group commit's wait, so the count of requests in handlers rose with the disk's
        latency, not the dispatcher's work, and heartbeats were refused on a core not busy.)"""
        counted = getattr(_admitted, "counting", False)
        if counted:
            with self._lock:
                self.pending -= 1
        try:
            yield
        finally:
            if counted:
                with self._lock:
                    self.pending += 1

    # ------------------------------------------------------------------ per liveness check
    def update(self, workers: int, clients: int, now: float) -> None:
        """Re-size the intervals to the population and to the load since the last call
        (`now`: the dispatcher's clock, which liveness compares with)."""
        wall_now, cpu = time.monotonic(), time.process_time()
        then, cpu_then, answered_then, refused_then = self._last
        with self._lock:
            answered, refused = self.answered, self.refused
        wall = max(1e-6, wall_now - then)
        self._last = (wall_now, cpu, answered, refused)
        self.cores = (cpu - cpu_then) / wall
        self.rpcs_per_s = (answered - answered_then) / wall
        self.refused_per_s = (refused - refused_then) / wall
        # Only refusals stretch further: CPU alone is no sign of trouble (a small fleet's
        # dispatcher may share a busy host) and must not slow its failure detection. A stray
        # refusal (a slow fsync holding requests) neither stretches nor relaxes.
        refused_now, answered_now = refused - refused_then, answered - answered_then
        if refused_now > REFUSED_SHARE * max(1, answered_now):
            self.load = min(MAX_LOAD_STRETCH, self.load * 1.5)
        elif not refused_now:
            self.load = max(1.0, self.load / 1.25)
        self.population = population_stretch(workers, clients, self.budget_rps)
        self.worker_ms = interval_ms(WORKER_DEFAULT_S, self.stretch, MAX_WORKER_INTERVAL_S)
        self.client_ms = interval_ms(CLIENT_DEFAULT_S, self.stretch, MAX_CLIENT_INTERVAL_S)
        self.split_cover_ms = split_cover_ms(workers, self.budget_rps, self.stretch, self.load)
        self._peaks["worker"].note(self.worker_ms / 1000, now)
        self._peaks["client"].note(self.client_ms / 1000, now)

    def fill(self, load: status_pb2.DispatcherLoad) -> None:
        """The load and intervals in force, for status and metrics."""
        load.cores, load.rpcs_per_s, load.refused_per_s = (
            self.cores, self.rpcs_per_s, self.refused_per_s)
        load.worker_heartbeat_ms, load.client_heartbeat_ms = self.worker_ms, self.client_ms
        load.stretch = self.stretch

    def timeout_s(self, kind: str, configured_s: float) -> float:
        """How long a `kind` ("worker" or "client") may be silent before it is taken for
        dead: the configured timeout, or LIVENESS_BEATS of the longest interval asked lately."""
        return max(configured_s, LIVENESS_BEATS * self._peaks[kind].interval_s)


def admitted(method: Callable[..., Any]) -> Callable[..., Any]:
    """Refuse the request with RESOURCE_EXHAUSTED and a retry-after (trailing metadata
    RETRY_AFTER_KEY, in ms) when the dispatcher is past its capacity (Cadence.admit)."""
    name = method.__name__

    @functools.wraps(method)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        queued_at = getattr(_queued, "at", None)
        retry_after = self.cadence.admit(
            name, 0.0 if queued_at is None else time.monotonic() - queued_at,
            getattr(_queued, "behind", True))
        if retry_after is not None:
            if name in HEARTBEATS:
                self.cadence.refused_beat(name, request, self._clock())
            ms = round(retry_after * 1000)
            context.set_trailing_metadata(((RETRY_AFTER_KEY, str(ms)),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the dispatcher is over its capacity ({self.cadence.max_pending} "
                          f"requests at once): retry after {ms} ms")
        _admitted.counting = True
        try:
            return method(self, request, context)
        finally:
            _admitted.counting = False
            self.cadence.done()

    return wrapper


_queued = threading.local()  # when the request this thread handles was queued, and whether
# it was queued behind others (no handler thread idle for it)
_admitted = threading.local()  # whether it counts as pending (Cadence.waiting_for_disk)


class QueuedExecutor(Executor):
    """The gRPC server's handler threads, with a queue where heartbeats wait behind every
    other request (a GetSplit overtakes the heartbeats queued before it: heartbeats are
    stretched before splits are delayed), noting when each request was queued and whether
    it had to wait behind others (see `admitted`): past capacity requests wait here, where
    no handler sees them otherwise."""

    def __init__(self, max_workers: int, thread_name_prefix: str = "grpc") -> None:
        self._cond = threading.Condition()
        self._first: deque[Callable[[], None] | None] = deque()
        self._heartbeats: deque[Callable[[], None] | None] = deque()
        self._shutdown = False
        self._idle = 0  # handler threads waiting for a request
        self._threads = [threading.Thread(target=self._work, daemon=True,
                                          name=f"{thread_name_prefix}_{i}")
                         for i in range(max_workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        queued = time.monotonic()
        future: Future[Any] = Future()

        behind = False  # set below, under the lock, before the request can run

        def timed() -> None:
            if not future.set_running_or_notify_cancel():
                return
            _queued.at, _queued.behind = queued, behind
            try:
                result = fn(*args, **kwargs)
            except BaseException as error:  # noqa: BLE001 - handed to the future
                future.set_exception(error)
            else:
                future.set_result(result)

        with self._cond:
            if self._shutdown:
                raise RuntimeError("cannot schedule new requests after shutdown")
            queue = self._heartbeats if _method_of(args) in HEARTBEATS else self._first
            behind = len(self._first) + len(self._heartbeats) >= self._idle
            queue.append(timed)
            self._cond.notify()
        return future

    def _work(self) -> None:
        while True:
            with self._cond:
                while not (self._first or self._heartbeats):
                    self._idle += 1
                    self._cond.wait()
                    self._idle -= 1
                task = (self._first or self._heartbeats).popleft()
            if task is None:
                return
            task()
            del task

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._cond:
            self._shutdown = True
            if cancel_futures:
                self._first.clear()
                self._heartbeats.clear()
            self._heartbeats.extend([None] * len(self._threads))  # after what is queued
            self._cond.notify_all()
        if wait:
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join()


def _method_of(args: tuple[Any, ...]) -> str:
    """The RPC's method name ("GetSplit") from what gRPC hands the executor (its call event),
    or "" if none is there. A registered method's call (generated stubs, as the dispatcher's
    services are added) names it in the event's tag, its details' method left empty; a
    generic handler's call names it in its details."""
    for arg in args:
        details = getattr(arg, "call_details", None)
        if details is not None:
            method = details.method or getattr(arg, "tag", None) or ""
            name = method.decode(errors="replace") if isinstance(method, bytes) else str(method)
            return name.rsplit("/", 1)[-1]
    return ""

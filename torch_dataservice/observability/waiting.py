"""A reader that waits says what for: after `wait_report_s()` (10 s; env
TORCH_DATASERVICE_WAIT_WARNING_S) and then as often, a WARNING while it waits for its first
element, INFO later. The reader knows what it is waiting on (`Waiting`); `describe` words it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch_dataservice.rpc import wait_report_s

logger = logging.getLogger("torch_dataservice.client.reader")


@dataclass
class Waiting:
    """What a blocked reader knows about why nothing arrives."""

    dispatcher: str
    iteration_id: int
    dispatcher_down_s: float = 0.0     # its heartbeats have failed this long
    workers_registered: int | None = None  # as the dispatcher says (None: unknown)
    unreachable: list[str] = field(default_factory=list)  # "worker A (via B)"
    serving: list[str] = field(default_factory=list)  # workers of its tasks


def describe(waiting: Waiting) -> str:
    if waiting.dispatcher_down_s > 0:
        return (f"dispatcher {waiting.dispatcher} unreachable, retrying "
                f"({waiting.dispatcher_down_s:.0f} s so far)")
    if waiting.unreachable:
        return f"{', '.join(waiting.unreachable)} unreachable, retrying"
    if not waiting.serving:
        if waiting.workers_registered == 0:
            return f"no worker has registered with the dispatcher at {waiting.dispatcher}"
        known = ("" if waiting.workers_registered is None
                 else f"{waiting.workers_registered} worker(s) registered, but ")
        return (f"{known}no worker has a task of iteration {waiting.iteration_id} yet "
                f"(dispatcher {waiting.dispatcher})")
    return (f"elements from {', '.join(waiting.serving)}: their pipelines have not produced "
            "any yet (slow start, or a slow pipeline)")


class WaitReport:
    """Logs, every `interval_s` of one wait, what the reader waits for."""

    def __init__(self, interval_s: float | None = None) -> None:
        self.interval_s = interval_s or wait_report_s()
        self._wait: float | None = None  # the wait being reported (its start)
        self._reports = 0

    def due(self, blocked_since: float | None, now: float) -> bool:
        if blocked_since != self._wait:
            self._wait, self._reports = blocked_since, 0
        return blocked_since is not None and (
            now - blocked_since >= self.interval_s * (self._reports + 1))

    def report(self, waiting: Waiting, waited_s: float, first_element: bool) -> None:
        self._reports = int(waited_s // self.interval_s)
        logger.log(logging.WARNING if first_element else logging.INFO,
                   "reader of iteration %d has waited %.0f s for %s: waiting for %s",
                   waiting.iteration_id, waited_s,
                   "its first element" if first_element else "an element", describe(waiting))

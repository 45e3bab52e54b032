"""A DispatcherService driven by hand (a settable clock, a context whose abort raises), and a
journal written from a list of updates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch_dataservice.config import DispatcherConfig
from torch_dataservice.dispatcher.file_journal import FileJournal
from torch_dataservice.dispatcher.journal import NullJournal
from torch_dataservice.dispatcher.service import DispatcherService
from torch_dataservice.dispatcher.state import DispatcherState


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Context:
    """What a handler's `context.abort(code, details)` does, as an exception to assert on."""

    def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"{code.name}: {details}")


def make_service(clock: Clock, work_dir: Path | None = None,
                 **config: Any) -> DispatcherService:
    """A service with a journal in `work_dir` (fault-tolerant mode), or none."""
    journal = FileJournal(work_dir) if work_dir else NullJournal()
    return DispatcherService(DispatcherConfig(
        fault_tolerant_mode=work_dir is not None, work_dir=str(work_dir) if work_dir else None,
        **config), journal, clock=clock)


def write_journal(work_dir: Path, updates: list, compact_every: int) -> tuple[DispatcherState, int]:
    """Journal and apply `updates` as the service does, compacting when due; returns the
    state and how many compactions happened (the journal is closed)."""
    journal = FileJournal(work_dir, compact_every=compact_every)
    state = DispatcherState()
    compactions = 0
    for update in updates:
        journal.append(update)
        state.apply(update)
        compactions += journal.maybe_compact(state)
    journal.sync()
    journal.close()
    return state, compactions


def client_request(service: DispatcherService, client_id: int) -> Any:
    """A heartbeat as a live reader sends it: fencing every lost task of its iteration (a
    reader fences what the previous reply listed as lost; see dispatcher/splits.py)."""
    from torch_dataservice.dispatcher import splits
    from torch_dataservice.proto import dispatcher_pb2

    iteration = service.state.iteration_of_client(client_id)
    return dispatcher_pb2.ClientHeartbeatRequest(
        client_id=client_id, fenced_tasks=sorted(splits.lost_tasks(service.state, iteration)))

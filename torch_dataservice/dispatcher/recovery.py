"""Starting from a journal: replay it into a state, and what a damaged one costs.

A record that does not apply is reported as a one-line `JournalCorruptError` naming the
record; after a journal was cut at damage (`journal_recovery="truncate"`), what the running
iterations handed out after the cut is unknown, so they are collected and their readers get
an error naming the recovery instead of data again.
"""

from __future__ import annotations

import logging

from torch_dataservice.dispatcher import liveness, snapshot
from torch_dataservice.dispatcher.journal import Journal
from torch_dataservice.dispatcher.soft import SoftState
from torch_dataservice.dispatcher.state import DispatcherState, InvalidTransition
from torch_dataservice.errors import FailedPreconditionError, JournalCorruptError
from torch_dataservice.proto import dispatcher_pb2

logger = logging.getLogger("torch_dataservice.dispatcher.service")

Update = dispatcher_pb2.Update


def replay(journal: Journal, *, reread: bool = False) -> DispatcherState:
    """The state the journal holds: its previous incarnations' (a start), or (`reread`)
    everything on disk now, this incarnation's too (a failed append: service.py)."""
    state = DispatcherState()
    records = 0
    for update in journal.reread() if reread else journal.replay():
        records += 1
        try:
            snapshot.apply(state, update)
        except JournalCorruptError:
            raise  # it says what is wrong already (e.g. a snapshot of a newer version)
        except InvalidTransition as error:
            raise JournalCorruptError(
                f"journal {journal.replay_position} does not apply to the state before it "
                f"({error}): the journal is damaged or was written by an incompatible "
                "version") from None
    if records:
        logger.info("dispatcher restored %d record(s) from the journal: %d dataset(s), %d "
                    "worker(s), %d iteration(s) not collected", records, len(state.datasets),
                    len(state.workers),
                    sum(not it.garbage_collected for it in state.iterations.values()))
    return state


SKIPPED_IDS = 100_000


def dropped_message(recovered_from: str) -> str:
    return (f"the dispatcher's journal was cut at damage ({recovered_from}); this reader's "
            "iteration cannot go on without reading data twice")


def check_client(state: DispatcherState, soft: SoftState, recovered_from: str | None,
                 client_id: int) -> None:
    """A client whose iteration a journal recovery dropped (or forgot) is told why."""
    if client_id in soft.dropped_clients or (
            recovered_from is not None and client_id not in state.clients):
        raise FailedPreconditionError(dropped_message(recovered_from or ""))


def drop_running(state: DispatcherState, soft: SoftState, recovered_from: str) -> list[Update]:
    """Collect every running iteration; their clients are told why (soft.dropped_clients)."""
    # Ids the lost records handed out (clients still use them) are not handed again.
    updates = [Update(skip_ids=dispatcher_pb2.SkipIds(count=SKIPPED_IDS))]
    for iteration in list(state.iterations.values()):
        if iteration.garbage_collected or state.is_finished(iteration):
            continue
        soft.dropped_clients.update(iteration.client_ids)
        updates += liveness.collect(state, iteration)
    return updates

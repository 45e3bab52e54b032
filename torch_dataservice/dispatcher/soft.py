"""SoftState: everything the dispatcher keeps outside the journal, in one place.

A restart forgets all of it and re-learns it (heartbeats, reports), so nothing here may decide
what was promised to anyone. `restored` says what a fresh dispatcher assumes after replay:
nothing is declared dead or collected because the dispatcher itself was down, and every
requeued split waits for fresh client reports. Workers and clients count as heard of when their
channels can have reconnected (rpc.RECONNECT_WITHIN_S after the restart), not at the restart:
a live worker whose channel was backing off would otherwise miss a short worker timeout, be
declared dead and lose its tasks (coordinated reads: it joins again with a new task).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch_dataservice.dispatcher.state import DispatcherState, Iteration
from torch_dataservice.rpc import RECONNECT_WITHIN_S


@dataclass
class RequeueScan:
    """The clients a requeue waits for (those of its iteration then), and how many of them
    reported since it (`since`: SoftState.requeued_at) and fenced the `lost` tasks."""

    since: int
    clients: list[int]
    lost: frozenset[int]
    position: int = 0


@dataclass
class SoftState:
    # Liveness: when each worker / client was last heard of, since when an iteration is idle.
    worker_seen: dict[str, float] = field(default_factory=dict)
    client_seen: dict[int, float] = field(default_factory=dict)
    iteration_idle_since: dict[int, float] = field(default_factory=dict)
    # Exactly-once DYNAMIC: client heartbeats are numbered; a requeued split is handed again
    # only once every client of its iteration heartbeated after it was requeued (or a
    # worker timeout passed: see dispatcher/splits.py).
    heartbeats: int = 0
    client_heartbeat: dict[int, int] = field(default_factory=dict)
    requeued_at: dict[int, int] = field(default_factory=dict)
    requeued_time: dict[int, float] = field(default_factory=dict)
    # ... and the iterations whose last requeue was found ready (every client reported): it
    # stays so until the next requeue, so GetSplit does not ask every client again per split.
    requeue_ready: set[int] = field(default_factory=set)
    # ... and, while it waits, how far the scan of its clients got (splits.requeue_ready).
    requeue_scan: dict[int, RequeueScan] = field(default_factory=dict)
    # The lost tasks each client fenced (accepts nothing from any more): a zombie worker's
    # splits are handed again only once every client fenced its tasks. Clients resend it.
    client_fenced: dict[int, frozenset[int]] = field(default_factory=dict)
    # Exactly-once DYNAMIC: clients silent for worker_timeout_ms (a trainer that died), and
    # the iterations that had one: what they did not acknowledge goes to the other clients.
    silent_clients: set[int] = field(default_factory=set)
    iterations_with_silent_clients: set[int] = field(default_factory=set)
    # ... and per client, the splits requeued since its last heartbeat: handed to the others
    # without its report if it was silent, so it drops what it holds of them when it is back.
    # Kept as one log per iteration and, per client, how much of it its last heartbeat (or
    # its joining) saw: a requeue costs the same with four or four thousand clients.
    requeue_log: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    requeue_seen: dict[int, int] = field(default_factory=dict)
    # ... and since when a finished iteration's clients wait for its splits to settle before
    # they are told it finished (dispatcher/splits.py end_held).
    end_unsettled_since: dict[int, float] = field(default_factory=dict)
    # Splits settled, (repetition, index, elements), for the next heartbeat reply of each
    # client that reported receiving some of them (it compacts what it remembers; a client
    # holds nothing of the others). `settle_watch`: per iteration, the clients that reported
    # each split not settled yet. Per report, not per client: a thousand readers must not
    # each hear of every split. Lost: clients miss compaction.
    settle_news: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)
    settle_watch: dict[int, dict[tuple[int, int], set[int]]] = field(default_factory=dict)
    # Coordinated reads: per iteration, consumer index -> (round it is blocked at on a lost
    # task, removals it knew then). Blocked consumers report in every heartbeat.
    blocked: dict[int, dict[int, tuple[int, int]]] = field(default_factory=dict)
    # ... each consumer's current round, and the round proposed for joining workers (see
    # dispatcher/coordinated.py plan_addition).
    rounds: dict[int, dict[int, int]] = field(default_factory=dict)
    proposals: dict[int, Any] = field(default_factory=dict)
    # Ephemeral datasets a registration was just answered with: kept for a job_gc_timeout_ms,
    # so the registrant's job finds them; then removed unless an iteration reads them.
    ephemeral_reused: dict[str, float] = field(default_factory=dict)
    # Clients whose iteration a journal recovery dropped.
    dropped_clients: set[int] = field(default_factory=set)
    # Split affinity (dispatcher/affinity.py): per worker, per dataset, the split indices it
    # holds cached (ascending) and the version of its report; per dataset, how many workers
    # hold each split; and where the last scan for a free split stopped (mere hints).
    held: dict[str, dict[str, tuple[int, ...]]] = field(default_factory=dict)
    held_version: dict[str, int] = field(default_factory=dict)
    holders: dict[str, dict[int, int]] = field(default_factory=dict)
    held_scan: dict[tuple[int, int, str], tuple[tuple[int, ...], int]] = field(
        default_factory=dict)
    unheld_scan: dict[tuple[int, int], int] = field(default_factory=dict)

    @classmethod
    def restored(cls, state: DispatcherState, now: float) -> SoftState:
        requeued_at = {i: 0 for i, it in state.iterations.items() if it.requeued}
        heard = now + RECONNECT_WITHIN_S
        return cls(
            worker_seen=dict.fromkeys(state.workers, heard),
            client_seen=dict.fromkeys(state.clients, heard),
            iteration_idle_since={i: now for i, it in state.iterations.items()
                                  if not it.garbage_collected and not it.client_ids},
            requeued_at=requeued_at,
            requeued_time=dict.fromkeys(requeued_at, now),
            ephemeral_reused={d: now for d, dataset in state.datasets.items()
                              if dataset.definition.ephemeral},
        )

    # ------------------------------------------------------------------ bookkeeping
    def note_heartbeat(self, client_id: int, now: float) -> None:
        self.heartbeats += 1
        self.client_heartbeat[client_id] = self.heartbeats
        self.client_seen[client_id] = now

    def note_requeue(self, iteration_id: int, now: float, *, keep: bool = False) -> None:
        """Requeued splits of `iteration_id` wait for client reports from now on (`keep`:
        unless they already wait, for an iteration that carried them over)."""
        if keep and iteration_id in self.requeued_at:
            return
        self.requeued_at[iteration_id] = self.heartbeats
        self.requeued_time[iteration_id] = now
        self.requeue_ready.discard(iteration_id)

    def note_silent(self, client_id: int, iteration_id: int) -> None:
        self.silent_clients.add(client_id)
        self.iterations_with_silent_clients.add(iteration_id)

    def note_requeued(self, iteration: Iteration, key: tuple[int, int]) -> None:
        if iteration.client_ids:
            self.requeue_log.setdefault(iteration.iteration_id, []).append(key)

    def note_joined(self, client_id: int, iteration: Iteration) -> None:
        """A new client: the splits requeued before it joined are none of its business."""
        self.requeue_seen[client_id] = len(self.requeue_log.get(iteration.iteration_id, ()))

    def back_from_silence(self, client_id: int, iteration: Iteration, now: float,
                          timeout_s: float) -> set[tuple[int, int]] | None:
        """A client heartbeats (before note_heartbeat): if it was silent for longer than
        `timeout_s` (the one liveness declares clients silent after: declared so, or not yet
        checked), the splits requeued meanwhile, and its iteration no longer waits for its
        silent clients' holdings at the end (it keeps what was not requeued, and acknowledges
        it as it takes it). None if it was not silent."""
        log = self.requeue_log.get(iteration.iteration_id, [])
        mark, self.requeue_seen[client_id] = self.requeue_seen.get(client_id, 0), len(log)
        seen = self.client_seen.get(client_id, now)
        if client_id not in self.silent_clients and now - seen <= timeout_s:
            return None
        self.silent_clients.discard(client_id)
        # The silent clients are few, the iteration's clients may be thousands.
        if not any(c in iteration.client_ids for c in self.silent_clients):
            self.iterations_with_silent_clients.discard(iteration.iteration_id)
        return set(log[mark:])

    def forget_client(self, client_id: int, iteration: Iteration, now: float) -> None:
        """A client left `iteration` (already applied to the state)."""
        self.client_seen.pop(client_id, None)
        self.client_heartbeat.pop(client_id, None)
        self.client_fenced.pop(client_id, None)
        self.silent_clients.discard(client_id)
        self.requeue_seen.pop(client_id, None)
        self.settle_news.pop(client_id, None)
        if not iteration.client_ids:
            self.settle_watch.pop(iteration.iteration_id, None)
            self.requeue_log.pop(iteration.iteration_id, None)
            self.iteration_idle_since[iteration.iteration_id] = now

    # ------------------------------------------------------------------ settled splits
    def note_reported(self, iteration: Iteration, client_id: int,
                      keys: list[tuple[int, int]]) -> None:
        """`client_id` reports receiving elements of the splits `keys` (before the report is
        applied): it hears of their settling, at once for those settled already."""
        watch = self.settle_watch.setdefault(iteration.iteration_id, {})
        requeued: set[tuple[int, int]] | None = None  # built only if needed: it may be long
        for key in keys:
            if key not in iteration.delivered and requeued is None:
                requeued = {(split.repetition, split.index) for split in iteration.requeued}
            if key in iteration.delivered or (requeued is not None and key in requeued):
                watch.setdefault(key, set()).add(client_id)
            elif key in iteration.sizes:
                self.settle_news.setdefault(client_id, []).append((*key, iteration.sizes[key]))

    def note_settled(self, iteration: Iteration, sizes: dict[tuple[int, int], int]) -> None:
        """Tell the clients that reported them of the splits among `sizes` (key -> elements)
        that the last update settled."""
        watch = self.settle_watch.get(iteration.iteration_id)
        if not watch:
            return
        for key, size in sizes.items():
            if key not in iteration.delivered:
                for client_id in watch.pop(key, ()):
                    if client_id in iteration.client_ids:
                        self.settle_news.setdefault(client_id, []).append((*key, size))

    def take_settled(self, client_id: int) -> list[tuple[int, int, int]]:
        """The settled splits `client_id` was not told of yet."""
        return self.settle_news.pop(client_id, [])

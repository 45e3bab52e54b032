"""Multi-step changes that several handlers share: a worker leaves, a silent client's splits
go back, requeued splits get takers, an idle iteration is collected.

Each step is a decision (dispatcher/liveness.py, splits.py, tasks.py) applied through the
service's `apply` (journal, then state) under its lock, so these steps change the state and
the soft state; what they leave to push to
workers is returned, for the service to push once the lock is released.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from torch_dataservice.dispatcher import affinity, liveness, splits, tasks
from torch_dataservice.dispatcher.observe import DispatcherObserver
from torch_dataservice.dispatcher.soft import SoftState
from torch_dataservice.dispatcher.state import DispatcherState, Iteration
from torch_dataservice.dispatcher.task_push import Push
from torch_dataservice.proto import dispatcher_pb2

logger = logging.getLogger(__name__)

Update = dispatcher_pb2.Update


class Effects:
    def __init__(self, state: DispatcherState, soft: SoftState,
                 apply: Callable[..., None], observe: DispatcherObserver,
                 clock: Callable[[], float], num_workers: int, gc_timeout_s: float) -> None:
        self._state = state
        self._soft = soft
        self._apply = apply
        self._observe = observe
        self._clock = clock
        self._num_workers = num_workers
        self._gc_timeout_s = gc_timeout_s

    def pushes(self, updates: Iterable[Update]) -> list[Push]:
        """The task definitions of the CreateTask updates among `updates` (applied)."""
        created = [self._state.task(u.create_task.task_id) for u in updates
                   if u.WhichOneof("kind") == "create_task"]
        return [(t.worker_address, tasks.task_def(self._state, t, self._num_workers))
                for t in created]

    def remove_worker(self, address: str) -> list[Push]:
        """Journal that a worker left; return the new tasks to push to the others.

        An iteration left with requeued splits and no unfinished task on a registered worker
        gets a task on every registered worker, which will take them (dispatcher/splits.py).
        """
        updates = liveness.remove_worker(self._state, address)
        requeued_in = {u.requeue_split.iteration_id for u in updates
                       if u.HasField("requeue_split")}
        self._apply(*updates)
        self._observe.forget_worker(address)
        affinity.forget_worker(self._soft, address)
        now, created = self._clock(), []
        for iteration_id in sorted(requeued_in):
            self._soft.note_requeue(iteration_id, now)
            iteration = self._state.iterations[iteration_id]
            logger.info("iteration %d: %d split(s) of worker %s requeued", iteration_id,
                        len(iteration.requeued), address)
            created += self.ensure_requeue_takers(iteration)
        return self.pushes(created)

    def requeue_unacknowledged(self, iteration: Iteration) -> list[Push]:
        """Once an iteration that lost a client ran out of tasks (dispatcher/splits.py)."""
        if iteration.iteration_id not in self._soft.iterations_with_silent_clients:
            return []
        updates = splits.requeue_unacknowledged(self._state, iteration)
        if not updates:
            return []
        self._apply(*updates)
        self._soft.note_requeue(iteration.iteration_id, self._clock())
        logger.info("iteration %d: %d split(s) a silent client may have held requeued",
                    iteration.iteration_id, len(updates))
        return self.pushes(self.ensure_requeue_takers(iteration))

    def ensure_requeue_takers(self, iteration: Iteration) -> list[Update]:
        if not splits.needs_takers(self._state, iteration):
            return []
        created = tasks.on_every_worker(self._state, iteration)
        self._apply(*created)
        return created

    def collect(self, iteration: Iteration, now: float) -> None:
        """Garbage-collect an idle iteration, and an ephemeral dataset nobody reads now."""
        self._apply(*liveness.collect(self._state, iteration))
        for coordination in (self._soft.blocked, self._soft.rounds, self._soft.proposals):
            coordination.pop(iteration.iteration_id, None)
        self._soft.iteration_idle_since.pop(iteration.iteration_id, None)
        dataset_id = self._state.job(iteration.job_id).config.dataset_id
        removal = liveness.unread_ephemeral(self._state, self._soft, dataset_id, now,
                                            self._gc_timeout_s)
        if removal is not None:
            logger.info("ephemeral dataset %s is no longer read: removed", dataset_id)
            self._apply(removal)

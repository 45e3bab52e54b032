"""Tasks: which worker gets a task of which iteration, and what a task tells its worker/client.

Pure: each function reads the state and returns `Update`s or messages. Several new tasks in one
decision take consecutive ids from the state's counter, in the order they are returned.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from torch_dataservice.dispatcher import splits
from torch_dataservice.dispatcher.coordinated import is_coordinated
from torch_dataservice.dispatcher.state import DispatcherState, Iteration, Task
from torch_dataservice.proto import common_pb2, dispatcher_pb2

Update = dispatcher_pb2.Update


def create_tasks(state: DispatcherState,
                 placements: Iterable[tuple[int, str]]) -> list[Update]:
    """CreateTask updates for (iteration id, worker address) pairs, with fresh ids."""
    first = state.peek_id("task")
    return [Update(create_task=dispatcher_pb2.CreateTask(
                task_id=first + i, iteration_id=iteration_id, worker_address=address))
            for i, (iteration_id, address) in enumerate(placements)]


def for_new_iteration(state: DispatcherState, iteration_id: int) -> list[Update]:
    """A new iteration gets a task on every registered worker."""
    return create_tasks(state, [(iteration_id, a) for a in sorted(state.workers)])


def for_new_worker(state: DispatcherState, address: str) -> list[Update]:
    """A worker that joins gets a task in every running iteration, except coordinated reads
    whose consumers agreed on a fixed task set (dispatcher/coordinated.py)."""
    return create_tasks(state, [
        (iteration.iteration_id, address) for iteration in list(state.active_iterations())
        if not (iteration.task_ids and is_coordinated(state, iteration))])


def on_every_worker(state: DispatcherState, iteration: Iteration) -> list[Update]:
    return create_tasks(state, [(iteration.iteration_id, a) for a in sorted(state.workers)])


def task_def(state: DispatcherState, task: Task, num_workers: int) -> common_pb2.TaskDef:
    """What a worker needs to run `task` (num_workers: the fixed list of static sharding)."""
    iteration = state.iteration(task.iteration_id)
    job = state.job(iteration.job_id)
    dataset = state.dataset(job.config.dataset_id)
    worker = state.workers.get(task.worker_address)
    definition = common_pb2.TaskDef(
        task_id=task.task_id,
        iteration_id=iteration.iteration_id,
        job_id=job.job_id,
        dataset_id=dataset.dataset_id,
        sharding_policy=job.config.sharding_policy,
        num_workers=num_workers,
        worker_index=worker.index if worker is not None else -1,
        cross_trainer_cache=job.config.cross_trainer_cache,
        compression=dataset.definition.compression,
        num_splits=dataset.definition.num_splits,
    )
    if job.config.HasField("num_consumers"):
        definition.num_consumers = job.config.num_consumers
    return definition


def task_infos(state: DispatcherState, iteration: Iteration) -> Iterator[common_pb2.TaskInfo]:
    """The tasks a client of `iteration` reads: unfinished ones on registered workers, or,
    for coordinated reads, all of them (the round robin is over the whole set)."""
    coordinated = is_coordinated(state, iteration)
    for task in state.iteration_tasks(iteration):
        worker = state.workers.get(task.worker_address)
        if (task.finished or worker is None) and not coordinated:
            continue
        info = common_pb2.TaskInfo(task_id=task.task_id, worker_address=task.worker_address,
                                   starting_round=task.starting_round, lost=task.lost)
        if worker is not None:
            info.worker_uid = worker.uid
            info.worker_index = worker.index
            info.host_id = worker.host_id
            info.process_id = worker.process_id
            info.data_port = worker.data_port
            info.data_socket = worker.data_socket
        yield info


@dataclass(frozen=True)
class ClientView:
    """What every heartbeating client of one iteration is told alike, at one version."""

    version: int
    finished: bool
    lost_task_ids: tuple[int, ...]  # exactly-once DYNAMIC only
    tasks: tuple[common_pb2.TaskInfo, ...]

    @functools.cached_property
    def tasks_bytes(self) -> bytes:
        """The task list as a serialized reply: merged into each reply that needs it, a
        thousand tasks cost a sixth of copying them message by message."""
        return dispatcher_pb2.ClientHeartbeatResponse(tasks=self.tasks).SerializeToString()


# Updates that may change a ClientView: workers and tasks that come and go, and requeued
# splits (an iteration holding some is not finished). Not the per-split traffic of DYNAMIC
# reads, nor clients that join or leave (a thousand readers joining must not each make every
# other reader's next reply carry the whole task list).
_VIEW_CHANGES = frozenset({"register_worker", "remove_worker", "create_task", "finish_task",
                           "garbage_collect_iteration", "remove_round_tasks", "requeue_split"})


class ClientViews:
    """ClientViews per iteration, rebuilt only after an update that may change them (a worker
    or task came or went), not per heartbeat: with a thousand workers, listing the tasks for
    every reader's heartbeat would take most of the dispatcher's CPU."""

    def __init__(self) -> None:
        # Versions of a restarted dispatcher never repeat an old one a client may hold.
        self._version = random.getrandbits(29) << 32
        self._views: dict[int, ClientView] = {}

    def note(self, update: Update) -> str | None:
        """`update` was applied to the state; returns its kind (the service's next question)."""
        kind = update.WhichOneof("kind")
        if kind in _VIEW_CHANGES or (kind == "produce_split" and update.produce_split.requeued):
            self._version += 1
        return kind

    def get(self, state: DispatcherState, iteration: Iteration) -> ClientView:
        view = self._views.get(iteration.iteration_id)
        if view is None or view.version != self._version:
            lost = (tuple(sorted(splits.lost_tasks(state, iteration)))
                    if splits.is_exactly_once(state, iteration) else ())
            view = self._views[iteration.iteration_id] = ClientView(
                self._version, state.is_finished(iteration), lost,
                tuple(task_infos(state, iteration)))
        return view

    def forget_collected(self, state: DispatcherState) -> None:
        for iteration_id in [i for i in self._views if i not in state.iterations
                             or state.iterations[i].garbage_collected]:
            del self._views[iteration_id]


def client_reply(state: DispatcherState, iteration: Iteration, view: ClientView,
                 known_version: int, settled: Iterable[tuple[int, int, int]],
                 proposal: Any = None,
                 end_held: bool = False) -> dispatcher_pb2.ClientHeartbeatResponse:
    """What a heartbeating client of `iteration` learns: its tasks (unless it holds the
    view's version: coordinated reads always get them), whether the iteration finished (not
    while `end_held`: see splits.end_held), the lost tasks to fence and the splits settled
    (exactly-once DYNAMIC), the removals and the proposed addition round (`proposal`) of
    coordinated reads."""
    reply = dispatcher_pb2.ClientHeartbeatResponse(
        iteration_finished=view.finished and not end_held, tasks_version=view.version)
    if proposal is not None:
        reply.addition_round = proposal.round
    reply.lost_task_ids.extend(view.lost_task_ids)
    for repetition, index, size in settled:
        reply.settled.add(split=common_pb2.SplitKey(repetition=repetition, index=index),
                          num_elements=size)
    if iteration.garbage_collected:
        reply.error = f"iteration {iteration.iteration_id} was garbage-collected"
    if is_coordinated(state, iteration):
        for removal_round, task_ids in iteration.removals:
            reply.removals.add(round=removal_round, task_ids=task_ids)
    elif known_version == view.version:
        reply.tasks_unchanged = True
        return reply
    reply.MergeFromString(view.tasks_bytes)
    return reply


def worker_task_changes(state: DispatcherState, address: str, current: Iterable[int],
                        num_workers: int) -> tuple[list[common_pb2.TaskDef], list[int]]:
    """A heartbeating worker's missing tasks, and the ones it must delete.

    A finished task stays on the worker until its iteration is gone, so that late readers get
    end_of_sequence instead of an unknown-task error; a lost task (its worker was declared
    dead: this one came back, a zombie) goes at once, as it was handed to others.
    """
    assigned = {t.task_id: t for t in state.worker_tasks(address)}
    current = set(current)
    new = [task_def(state, task, num_workers) for task_id, task in assigned.items()
           if task_id not in current]
    delete = []
    for task_id in sorted(current - assigned.keys()):
        task = state.tasks.get(task_id)
        if task is None or task.lost or state.iteration(task.iteration_id).garbage_collected:
            delete.append(task_id)
    return new, delete

"""DispatcherState: the dispatcher's whole durable state, changed only by `apply(update)`.

Pure: no I/O, no clocks, no gRPC. The service decides which `Update` to make, journals it
(fault-tolerant mode) and applies it here; a restart replays the journal into a fresh state.
Queries never mutate. Ids come from per-kind counters (datasets from 1000, iterations 2000,
clients 3000, tasks 4000, jobs 5000) so an id in a log line says what it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from torch_dataservice.dispatcher import resume
from torch_dataservice.dispatcher.split_sizes import SplitSizes
from torch_dataservice.policies import STATIC_POLICIES, ShardingPolicy
from torch_dataservice.proto import common_pb2, dispatcher_pb2

Update = dispatcher_pb2.Update

ID_BASES = {"dataset": 1000, "iteration": 2000, "client": 3000, "task": 4000, "job": 5000}


def received_offsets(received: dispatcher_pb2.ReceivedSplit) -> Iterable[int]:
    """Every offset a ReceivedSplit names: its `offsets` and its [start, end) `offset_ranges`
    (checked by dispatcher/splits.py before they are journaled)."""
    ranges = received.offset_ranges
    if not ranges:
        return received.offsets
    offsets = list(received.offsets)
    for start, end in zip(ranges[::2], ranges[1::2], strict=True):
        offsets.extend(range(start, end))
    return offsets


class InvalidTransition(RuntimeError):
    """An update that does not fit the current state: a bug in the caller or a corrupt journal."""


@dataclass
class Dataset:
    dataset_id: str
    definition: common_pb2.DatasetDef


@dataclass
class Worker:
    address: str
    uid: int
    index: int
    host_id: str
    process_id: str
    task_ids: set[int] = field(default_factory=set)  # unfinished tasks assigned to it
    data_port: int = 0  # its data port (worker/data_port.py), 0 without one
    data_socket: str = ""


@dataclass
class Job:
    job_id: int
    name: str
    config: common_pb2.JobConfig


@dataclass
class Task:
    task_id: int
    iteration_id: int
    worker_address: str
    starting_round: int = 0
    finished: bool = False
    # Finished because its worker left, not because it ran to its end.
    lost: bool = False
    # DYNAMIC exactly-once: splits handed to this task, by (repetition, index), until every
    # element of them is delivered (settled) or they are requeued.
    splits: set[tuple[int, int]] = field(default_factory=set)
    # The last GetSplit answered per replica: (request id, the (repetition, split index or -1)
    # it handed, in order), so a retried request gets the same splits back instead of losing
    # them.
    last_split: dict[int, tuple[int, tuple[tuple[int, int], ...]]] = field(
        default_factory=dict)

    def __post_init__(self) -> None:
        # Whether a compaction's copy of the state shares `splits` (snapshot.py copies the
        # state under the dispatcher's lock; sharing what it would copy keeps that short).
        # Derived (not a field): a shared set is copied before it changes (own_splits).
        self.splits_shared = False

    def own_splits(self) -> set[tuple[int, int]]:
        """`splits`, to change: copied first if a compaction's copy still shares it."""
        if self.splits_shared:
            self.splits, self.splits_shared = set(self.splits), False
        return self.splits


@dataclass
class RequeuedSplit:
    repetition: int
    index: int
    delivered_offsets: frozenset[int]


@dataclass
class Iteration:
    iteration_id: int
    job_id: int
    repetition: int
    task_ids: list[int] = field(default_factory=list)
    client_ids: set[int] = field(default_factory=set)
    garbage_collected: bool = False
    # DYNAMIC split cursor: the repetition being handed out and the next split index in it,
    # and the splits of that repetition handed ahead of it (split affinity: a worker that
    # holds one cached got it first, dispatcher/affinity.py). The cursor steps over those when
    # it gets there, so its next split is never one of them and all of them lie beyond it.
    cursor_repetition: int = 0
    cursor_index: int = 0
    ahead: set[int] = field(default_factory=set)
    requeued: list[RequeuedSplit] = field(default_factory=list)
    # Exactly-once DYNAMIC, for splits handed out and not settled: the offsets clients reported
    # received, and (once the worker finished producing it) how many elements the split has.
    delivered: dict[tuple[int, int], set[int]] = field(default_factory=dict)
    produced: dict[tuple[int, int], int] = field(default_factory=dict)
    # Coordinated reads: (round, task ids) per removal of lost tasks, in decision order.
    removals: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    # DYNAMIC: every split's element count once a worker finished producing it, kept after it
    # settles (GetSplitSizes: a loader's state names the splits its trainer read whole); runs
    # of equal counts, so it does not grow with the epoch (split_sizes.py).
    sizes: SplitSizes = field(default_factory=SplitSizes)

    def __post_init__(self) -> None:
        # The tasks holding each split: Task.splits inverted, so a split settles or is
        # requeued at a cost that does not grow with the iteration's tasks. Derived (not a
        # field: neither snapshotted nor compared); snapshot.py rebuilds it.
        self.holders: dict[tuple[int, int], set[int]] = {}
        # The splits whose offset sets in `delivered` a compaction's copy may still share:
        # such a set is copied before it changes (offsets_to_change), never changed in place.
        self.shared_offsets: set[tuple[int, int]] = set()

    def hold(self, task: Task, key: tuple[int, int]) -> None:
        task.own_splits().add(key)
        self.holders.setdefault(key, set()).add(task.task_id)

    def release(self, tasks: dict[int, Task], key: tuple[int, int]) -> None:
        """No task holds split `key` any more."""
        for task_id in self.holders.pop(key, ()):
            tasks[task_id].own_splits().discard(key)

    def offsets_to_change(self, key: tuple[int, int]) -> set[int]:
        """The offsets received of split `key` (tracked from now on if it was not), to add
        to: copied first if a compaction's copy may still share them."""
        offsets = self.delivered.get(key)
        if offsets is None:
            offsets = self.delivered[key] = set()
        elif key in self.shared_offsets:
            self.shared_offsets.discard(key)
            offsets = self.delivered[key] = set(offsets)
        return offsets


@dataclass
class DispatcherState:
    datasets: dict[str, Dataset] = field(default_factory=dict)
    dataset_by_fingerprint: dict[str, str] = field(default_factory=dict)
    workers: dict[str, Worker] = field(default_factory=dict)
    jobs: dict[int, Job] = field(default_factory=dict)
    job_by_name: dict[str, int] = field(default_factory=dict)
    iterations: dict[int, Iteration] = field(default_factory=dict)
    iteration_by_key: dict[tuple[int, int], int] = field(default_factory=dict)
    tasks: dict[int, Task] = field(default_factory=dict)
    clients: dict[int, int] = field(default_factory=dict)  # client id -> iteration id
    next_ids: dict[str, int] = field(default_factory=lambda: dict(ID_BASES))

    # ------------------------------------------------------------------ the one mutation
    def apply(self, update: Update) -> None:
        kind = update.WhichOneof("kind")
        if kind is None:
            raise InvalidTransition("empty update")
        getattr(self, f"_apply_{kind}")(getattr(update, kind))

    def _take_id(self, kind: str, value: int) -> None:
        # Ids are chosen by the service (peek_id) and recorded here, so replay reproduces them.
        self.next_ids[kind] = max(self.next_ids[kind], value + 1)

    def _apply_register_dataset(self, u: dispatcher_pb2.RegisterDataset) -> None:
        self.datasets[u.dataset_id] = Dataset(u.dataset_id, u.dataset)
        if u.dataset.fingerprint:
            self.dataset_by_fingerprint.setdefault(u.dataset.fingerprint, u.dataset_id)
        if u.dataset_id.isdigit():
            self._take_id("dataset", int(u.dataset_id))

    def _apply_register_worker(self, u: dispatcher_pb2.RegisterWorker) -> None:
        if u.worker_address in self.workers:
            raise InvalidTransition(f"worker {u.worker_address} is already registered")
        self.workers[u.worker_address] = Worker(
            u.worker_address, u.worker_uid, u.worker_index, u.host_id, u.process_id,
            data_port=u.data_port, data_socket=u.data_socket,
        )

    def _apply_remove_worker(self, u: dispatcher_pb2.RemoveWorker) -> None:
        worker = self.workers.pop(u.worker_address, None)
        if worker is None:
            raise InvalidTransition(f"worker {u.worker_address} is not registered")
        for task_id in sorted(worker.task_ids):
            self.tasks[task_id].lost = True
            self._finish_task(self.tasks[task_id])
        # Coordinated reads: a task that ended for the fastest consumer still holds rounds
        # the others need; they must learn that it is gone too.
        for iteration in self.iterations.values():
            if not iteration.garbage_collected and self.jobs[
                    iteration.job_id].config.HasField("num_consumers"):
                for task_id in iteration.task_ids:
                    if self.tasks[task_id].worker_address == u.worker_address:
                        self.tasks[task_id].lost = True

    def _apply_create_job(self, u: dispatcher_pb2.CreateJob) -> None:
        name = u.config.job_name
        if name in self.job_by_name:
            raise InvalidTransition(f"job name {name!r} already exists")
        self.jobs[u.job_id] = Job(u.job_id, name, u.config)
        if name:  # an anonymous job has no name, so no user-chosen name can collide with it
            self.job_by_name[name] = u.job_id
        self._take_id("job", u.job_id)

    def _apply_create_iteration(self, u: dispatcher_pb2.CreateIteration) -> None:
        key = (u.job_id, u.repetition)
        old = self.iteration_by_key.get(key)
        if old is not None and not self.iterations[old].garbage_collected:
            raise InvalidTransition(f"iteration {key} already exists as {old}")
        iteration = Iteration(u.iteration_id, u.job_id, u.repetition)
        if old is not None:
            # Recreated after garbage collection: the split cursor (and the splits requeued
            # from the collected tasks) carry over, so a resumed trainer continues its epoch
            # instead of revisiting data.
            collected = self.iterations[old]
            iteration.cursor_repetition = collected.cursor_repetition
            iteration.cursor_index = collected.cursor_index
            iteration.ahead = set(collected.ahead)
            iteration.requeued, collected.requeued = collected.requeued, []
        self.iterations[u.iteration_id] = iteration
        self.iteration_by_key[key] = u.iteration_id
        self._take_id("iteration", u.iteration_id)

    def _apply_create_task(self, u: dispatcher_pb2.CreateTask) -> None:
        iteration = self.iterations[u.iteration_id]
        task = Task(u.task_id, u.iteration_id, u.worker_address, u.starting_round)
        self.tasks[u.task_id] = task
        iteration.task_ids.append(u.task_id)
        self.workers[u.worker_address].task_ids.add(u.task_id)
        self._take_id("task", u.task_id)

    def _apply_finish_task(self, u: dispatcher_pb2.FinishTask) -> None:
        self._finish_task(self.tasks[u.task_id])

    def _finish_task(self, task: Task) -> None:
        task.finished = True
        worker = self.workers.get(task.worker_address)
        if worker is not None:
            worker.task_ids.discard(task.task_id)

    def _apply_produce_split(self, u: dispatcher_pb2.ProduceSplit) -> None:
        iteration = self.iterations[u.iteration_id]
        task = self.tasks.get(u.task_id)
        if task is not None and u.request_id:
            # Several ProduceSplit records of one request (max_splits) make one answer.
            request_id, keys = task.last_split.get(u.replica, (None, ()))
            if request_id != u.request_id:
                keys = ()
            task.last_split[u.replica] = (u.request_id, (*keys, (u.repetition, u.split_index)))
        key = (u.repetition, u.split_index)
        if u.requeued:
            for i, split in enumerate(iteration.requeued):
                if (split.repetition, split.index) == key:
                    del iteration.requeued[i]
                    iteration.delivered[key] = set(split.delivered_offsets)
                    break
            else:
                raise InvalidTransition(f"split {u.repetition}/{u.split_index} was not requeued")
        elif u.repetition < iteration.cursor_repetition:
            raise InvalidTransition(
                f"split of repetition {u.repetition} after the cursor reached "
                f"{iteration.cursor_repetition}"
            )
        else:
            if u.repetition > iteration.cursor_repetition:
                iteration.cursor_repetition, iteration.cursor_index = u.repetition, 0
                iteration.ahead.clear()
            if u.split_index < 0:  # end of splits: the next repetition starts
                iteration.cursor_repetition, iteration.cursor_index = u.repetition + 1, 0
                iteration.ahead.clear()
                return
            config = self.jobs[iteration.job_id].config
            # A resumed job's cursor steps over the splits read whole before (resume.py).
            expected = resume.first_unconsumed(config, u.repetition, iteration.cursor_index)
            if u.ahead:
                self._check_ahead(iteration, config, u, expected)
                iteration.ahead.add(u.split_index)
            elif u.split_index != expected:
                raise InvalidTransition(
                    f"split {u.split_index} out of order (cursor at {iteration.cursor_index}, "
                    f"next unconsumed {expected})"
                )
            else:
                iteration.cursor_index = u.split_index + 1
                self._step_over_ahead(iteration, config)
            iteration.offsets_to_change(key).update(
                resume.consumed_offsets(config, u.repetition, u.split_index))
        if task is not None and u.split_index >= 0:
            iteration.hold(task, key)

    def _check_ahead(self, iteration: Iteration, config: common_pb2.JobConfig,
                     u: dispatcher_pb2.ProduceSplit, expected: int) -> None:
        """A split handed ahead lies beyond the cursor's next split, in the cursor's
        repetition, among the splits, not handed nor read before a resume."""
        num_splits = self.datasets[config.dataset_id].definition.num_splits
        if (u.repetition != iteration.cursor_repetition or u.requeued
                or not expected < u.split_index < num_splits
                or u.split_index in iteration.ahead
                or resume.first_unconsumed(config, u.repetition, u.split_index)
                != u.split_index):
            raise InvalidTransition(
                f"split {u.repetition}/{u.split_index} cannot be handed ahead (cursor at "
                f"{iteration.cursor_repetition}/{iteration.cursor_index}, next {expected}, "
                f"{len(iteration.ahead)} handed ahead)")

    @staticmethod
    def _step_over_ahead(iteration: Iteration, config: common_pb2.JobConfig) -> None:
        """Move the cursor past the splits handed ahead that it reached: its next split is
        then never one of them (dispatcher/splits.py hands it as is)."""
        while iteration.ahead:
            following = resume.first_unconsumed(config, iteration.cursor_repetition,
                                                iteration.cursor_index)
            if following not in iteration.ahead:
                return
            iteration.ahead.discard(following)
            iteration.cursor_index = following + 1

    def _apply_requeue_split(self, u: dispatcher_pb2.RequeueSplit) -> None:
        iteration = self.iterations[u.iteration_id]
        key = (u.split.repetition, u.split.index)
        iteration.release(self.tasks, key)
        delivered = iteration.delivered.pop(key, set()) | set(u.delivered_offsets)
        iteration.produced.pop(key, None)
        iteration.requeued.append(RequeuedSplit(key[0], key[1], frozenset(delivered)))

    def _apply_record_delivered(self, u: dispatcher_pb2.RecordDelivered) -> None:
        iteration = self.iterations.get(u.iteration_id)
        if iteration is None:
            return
        for received in u.splits:
            key = (received.split.repetition, received.split.index)
            if key in iteration.delivered:
                iteration.offsets_to_change(key).update(received_offsets(received))
                self._settle_if_delivered(iteration, key)
                continue
            # Still waiting to be handed again: what arrives late still counts as delivered.
            for i, split in enumerate(iteration.requeued):
                if (split.repetition, split.index) == key:
                    iteration.requeued[i] = RequeuedSplit(
                        key[0], key[1],
                        split.delivered_offsets | frozenset(received_offsets(received)))
        # Reports about settled or unknown splits change nothing: they were delivered already.

    def _apply_split_produced(self, u: dispatcher_pb2.SplitProduced) -> None:
        iteration = self.iterations.get(u.iteration_id)
        key = (u.split.repetition, u.split.index)
        if iteration is None or key not in iteration.delivered:
            return
        iteration.produced[key] = u.num_elements
        iteration.sizes[key] = u.num_elements
        self._settle_if_delivered(iteration, key)

    def _settle_if_delivered(self, iteration: Iteration, key: tuple[int, int]) -> None:
        """Forget a split once clients received every element it produced."""
        size = iteration.produced.get(key)
        if size is None or not iteration.delivered[key].issuperset(range(size)):
            return
        del iteration.delivered[key], iteration.produced[key]
        iteration.release(self.tasks, key)

    def _apply_snapshot(self, u: dispatcher_pb2.StateSnapshot) -> None:
        raise InvalidTransition("a snapshot record replaces the state: apply it with "
                                "dispatcher/snapshot.py apply()")

    def replace_with(self, other: DispatcherState) -> None:
        """Become `other` (a snapshot record restores the whole state in place)."""
        self.__dict__.clear()
        self.__dict__.update(other.__dict__)

    def _apply_batch(self, u: dispatcher_pb2.UpdateBatch) -> None:
        """One request's updates, journaled as one record (service.py), applied in order."""
        for update in u.updates:
            if update.WhichOneof("kind") in ("batch", "snapshot"):
                raise InvalidTransition(f"a batch holds a {update.WhichOneof('kind')!r} update")
            self.apply(update)

    def _apply_skip_ids(self, u: dispatcher_pb2.SkipIds) -> None:
        for kind in self.next_ids:
            self.next_ids[kind] += u.count

    def _apply_acquire_client(self, u: dispatcher_pb2.AcquireClient) -> None:
        self.clients[u.client_id] = u.iteration_id
        self.iterations[u.iteration_id].client_ids.add(u.client_id)
        self._take_id("client", u.client_id)

    def _apply_release_client(self, u: dispatcher_pb2.ReleaseClient) -> None:
        iteration_id = self.clients.pop(u.client_id, None)
        if iteration_id is not None:
            self.iterations[iteration_id].client_ids.discard(u.client_id)

    def _apply_remove_dataset(self, u: dispatcher_pb2.RemoveDataset) -> None:
        dataset = self.datasets.pop(u.dataset_id, None)
        if dataset is None:
            raise InvalidTransition(f"dataset {u.dataset_id!r} is not registered")
        fingerprint = dataset.definition.fingerprint
        if self.dataset_by_fingerprint.get(fingerprint) == u.dataset_id:
            del self.dataset_by_fingerprint[fingerprint]

    def _apply_remove_round_tasks(self, u: dispatcher_pb2.RemoveRoundTasks) -> None:
        iteration = self.iterations[u.iteration_id]
        removed = {t for _, tasks in iteration.removals for t in tasks}
        for task_id in u.removal.task_ids:
            task = self.tasks.get(task_id)
            if task is None or task.iteration_id != u.iteration_id or not task.lost:
                raise InvalidTransition(f"task {task_id} is not a lost task of iteration "
                                        f"{u.iteration_id}")
            if task_id in removed:
                raise InvalidTransition(f"task {task_id} was removed already")
        if iteration.removals and u.removal.round < iteration.removals[-1][0]:
            raise InvalidTransition(
                f"removal round {u.removal.round} precedes {iteration.removals[-1][0]}")
        iteration.removals.append((u.removal.round, tuple(u.removal.task_ids)))

    def _apply_garbage_collect_iteration(self, u: dispatcher_pb2.GarbageCollectIteration) -> None:
        iteration = self.iterations[u.iteration_id]
        iteration.garbage_collected = True
        for task_id in iteration.task_ids:
            self._finish_task(self.tasks[task_id])
            self.tasks[task_id].own_splits().clear()  # memory: the split bookkeeping goes too
        iteration.holders.clear()
        iteration.delivered.clear()
        iteration.produced.clear()
        iteration.sizes.clear()
        for client_id in list(iteration.client_ids):
            self.clients.pop(client_id, None)
        iteration.client_ids.clear()

    # ------------------------------------------------------------------ queries
    def peek_id(self, kind: str) -> int:
        return self.next_ids[kind]

    def latest_repetition(self, job_id: int) -> int:
        """The highest repetition of `job_id` that has (or had) an iteration, 0 if none."""
        return max((r for j, r in self.iteration_by_key if j == job_id), default=0)

    def free_dataset_id(self) -> str:
        """The next dataset id no dataset has (a user may have chosen ids explicitly)."""
        dataset_id = self.peek_id("dataset")
        while str(dataset_id) in self.datasets:
            dataset_id += 1
        return str(dataset_id)

    def dataset(self, dataset_id: str) -> Dataset:
        try:
            return self.datasets[dataset_id]
        except KeyError:
            raise LookupError(f"dataset {dataset_id!r} is not registered") from None

    def job(self, job_id: int) -> Job:
        try:
            return self.jobs[job_id]
        except KeyError:
            raise LookupError(f"job {job_id} does not exist") from None

    def iteration(self, iteration_id: int) -> Iteration:
        try:
            return self.iterations[iteration_id]
        except KeyError:
            raise LookupError(f"iteration {iteration_id} does not exist") from None

    def iteration_of_client(self, client_id: int) -> Iteration:
        try:
            return self.iterations[self.clients[client_id]]
        except KeyError:
            raise LookupError(f"iteration client {client_id} is not known") from None

    def task(self, task_id: int) -> Task:
        try:
            return self.tasks[task_id]
        except KeyError:
            raise LookupError(f"task {task_id} does not exist") from None

    def iteration_tasks(self, iteration: Iteration) -> Iterator[Task]:
        return (self.tasks[task_id] for task_id in iteration.task_ids)

    def is_finished(self, iteration: Iteration) -> bool:
        """Every task ran to its end (or its worker left); an iteration with none is not."""
        if iteration.garbage_collected:
            return True
        if iteration.requeued:  # a dead worker's splits wait for a live one
            return False
        tasks = list(self.iteration_tasks(iteration))
        if not tasks or not all(task.finished for task in tasks):
            return False
        config = self.jobs[iteration.job_id].config
        if config.HasField("num_consumers"):
            # Consumers agree on removals; one whose every task was lost waits for a worker
            # to join (a rolling restart of a one-worker job), as OFF does below.
            return not all(t.lost for t in tasks)
        if config.sharding_policy == ShardingPolicy.DYNAMIC:
            return True  # lost splits were requeued
        # A task's work belongs to its worker's address: a static shard, or under OFF the whole
        # dataset. A task lost with its worker is done once a task at that address finished in
        # its place (a restarted worker starts the task over, as in tf.data service). Under
        # OFF, a worker that does not come back is given up (at most once, as tf.data service)
        # once another task finished; an iteration whose every task was lost waits for a worker
        # rather than end the epoch silently.
        done = {t.worker_address for t in tasks if not t.lost}
        if config.sharding_policy in STATIC_POLICIES:
            return all(t.worker_address in done for t in tasks)
        return bool(done) and all(
            t.worker_address in done or t.worker_address not in self.workers for t in tasks)

    def active_iterations(self) -> Iterator[Iteration]:
        return (
            it
            for it in self.iterations.values()
            if not it.garbage_collected and not self.is_finished(it)
        )

    def worker_tasks(self, address: str) -> list[Task]:
        worker = self.workers.get(address)
        if worker is None:
            return []
        return [self.tasks[task_id] for task_id in sorted(worker.task_ids)]

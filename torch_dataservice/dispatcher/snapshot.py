"""DispatcherState <-> `DispatcherSnapshot` (protos/.../snapshot.proto), for journal compaction.

A protobuf snapshot, unlike the pickle it replaces, is read by any later version that knows its
`schema_version`, and reading it executes nothing. `COVERED` names every dataclass field mapped
here; tests/dispatcher/test_snapshot.py fails when a state field is missing from it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TypeVar

from google.protobuf.message import DecodeError

from torch_dataservice.dispatcher.split_sizes import SplitSizes
from torch_dataservice.dispatcher.state import (
    Dataset,
    DispatcherState,
    InvalidTransition,
    Iteration,
    Job,
    RequeuedSplit,
    Task,
    Worker,
)
from torch_dataservice.errors import JournalCorruptError
from torch_dataservice.proto import common_pb2, dispatcher_pb2, snapshot_pb2

DispatcherSnapshot = snapshot_pb2.DispatcherSnapshot
Update = dispatcher_pb2.Update
_T = TypeVar("_T")
_S = DispatcherSnapshot

# Raise when a change would make an older reader misread a snapshot (and teach from_proto to
# read the older versions still found on disk). 2: iterations hold the splits handed ahead of
# their cursor (split affinity), which a version-1 reader would hand again; a version-1
# snapshot reads as having none. 3: split sizes as runs (`size_runs`), which a version-2
# reader would read as none (and GetSplitSizes answer nothing); version 2's `sizes` still read.
# 4: delivered, produced and task splits as columns of integers, which a version-3 reader would
# read as none (handing every split in flight again); version 3's messages still read.
SCHEMA_VERSION = 4

# The fields of each state dataclass that to_proto and from_proto carry: extend both, the proto
# and this table when adding a field to state.py.
COVERED: dict[type, tuple[str, ...]] = {
    Dataset: ("dataset_id", "definition"),
    Worker: ("address", "uid", "index", "host_id", "process_id", "task_ids", "data_port",
             "data_socket"),
    Job: ("job_id", "name", "config"),
    Task: ("task_id", "iteration_id", "worker_address", "starting_round", "finished", "lost",
           "splits", "last_split"),
    RequeuedSplit: ("repetition", "index", "delivered_offsets"),
    Iteration: ("iteration_id", "job_id", "repetition", "task_ids", "client_ids",
                "garbage_collected", "cursor_repetition", "cursor_index", "ahead", "requeued",
                "delivered", "produced", "removals", "sizes"),
    DispatcherState: ("datasets", "dataset_by_fingerprint", "workers", "jobs", "job_by_name",
                      "iterations", "iteration_by_key", "tasks", "clients", "next_ids"),
}


class UnsupportedSnapshot(InvalidTransition, JournalCorruptError):
    """A snapshot this version cannot read: newer schema, or not a DispatcherSnapshot at all."""


def _key(key: tuple[int, int]) -> common_pb2.SplitKey:
    return common_pb2.SplitKey(repetition=key[0], index=key[1])


def _task(task: Task) -> snapshot_pb2.DispatcherSnapshot.Task:
    keys = sorted(task.splits)
    return _S.Task(
        task_id=task.task_id, iteration_id=task.iteration_id,
        worker_address=task.worker_address, starting_round=task.starting_round,
        finished=task.finished, lost=task.lost,
        split_repetitions=[key[0] for key in keys], split_indices=[key[1] for key in keys],
        last_split=[_S.LastSplit(replica=replica, request_id=request_id,
                                 splits=[_key(key) for key in keys])
                    for replica, (request_id, keys) in task.last_split.items()],
    )


def _iteration(it: Iteration) -> snapshot_pb2.DispatcherSnapshot.Iteration:
    # Columns of plain integers (schema 4): a message per split cost a compaction of a
    # thousand workers' stocks (80,000 splits handed, not settled) a second of CPU. Filled
    # from generators, not lists: a list of tens of thousands of entries is walked by every
    # young collection while it lives (10-20 ms each, whichever thread collects).
    delivered = it.delivered
    produced = it.produced
    return _S.Iteration(
        iteration_id=it.iteration_id, job_id=it.job_id, repetition=it.repetition,
        task_ids=it.task_ids, client_ids=sorted(it.client_ids),
        garbage_collected=it.garbage_collected,
        cursor_repetition=it.cursor_repetition, cursor_index=it.cursor_index,
        ahead=sorted(it.ahead),
        requeued=[_S.RequeuedSplit(split=_key((r.repetition, r.index)),
                                   delivered_offsets=sorted(r.delivered_offsets))
                  for r in it.requeued],
        delivered_repetitions=(key[0] for key in delivered),
        delivered_indices=(key[1] for key in delivered),
        delivered_offset_counts=(len(o) for o in delivered.values()),
        delivered_offsets=(offset for o in delivered.values()
                           for offset in (sorted(o) if len(o) > 1 else o)),
        produced_repetitions=(key[0] for key in produced),
        produced_indices=(key[1] for key in produced),
        produced_elements=produced.values(),
        size_runs=[_S.SizeRun(repetition=repetition, first=first, end=end, num_elements=n)
                   for repetition, first, end, n in it.sizes.runs()],
        removals=[common_pb2.RemovedTasks(round=r, task_ids=tasks) for r, tasks in it.removals],
    )


def copy_for_snapshot(state: DispatcherState) -> DispatcherState:
    """What `to_proto` reads of `state` (the COVERED fields), copied so that later updates
    to `state` do not show: a compaction copies under the dispatcher's lock and builds the
    snapshot from the copy off it. Plain containers only, no protobuf; protobuf values
    (dataset definitions, job configs) are shared, as the state never changes them in place.
    The biggest parts, each task's splits and each split's offsets received (tens of
    thousands of sets in a big fleet: most of a 40-85 ms copy), are shared too, and marked
    in `state`, which copies one before changing it (Task.own_splits,
    Iteration.offsets_to_change)."""
    copied = DispatcherState(
        datasets={k: replace(d) for k, d in state.datasets.items()},
        dataset_by_fingerprint=dict(state.dataset_by_fingerprint),
        workers={k: _copy_worker(w) for k, w in state.workers.items()},
        jobs={k: replace(j) for k, j in state.jobs.items()},
        job_by_name=dict(state.job_by_name),
        iterations={k: _copy_iteration(it) for k, it in state.iterations.items()},
        iteration_by_key=dict(state.iteration_by_key),
        tasks={k: _share_task(t) for k, t in state.tasks.items()},
        clients=dict(state.clients),
        next_ids=dict(state.next_ids),
    )
    return copied


def _shallow(value: _T) -> _T:
    """A copy sharing every attribute of `value`, a dataclass: `dataclasses.replace` runs
    `__init__` again, several times slower, for each of thousands of workers and tasks."""
    copied = object.__new__(type(value))
    copied.__dict__.update(value.__dict__)
    return copied


def _copy_worker(worker: Worker) -> Worker:
    copied = _shallow(worker)
    copied.task_ids = set(worker.task_ids)
    return copied


def _share_task(task: Task) -> Task:
    task.splits_shared = True  # the copy's `splits` is this one: copied before it changes
    copied = _shallow(task)
    copied.last_split = dict(task.last_split)
    return copied


def _copy_iteration(it: Iteration) -> Iteration:
    it.shared_offsets = set(it.delivered)
    return replace(
        it, task_ids=list(it.task_ids), client_ids=set(it.client_ids), ahead=set(it.ahead),
        requeued=[replace(r) for r in it.requeued], delivered=dict(it.delivered),
        produced=dict(it.produced), removals=list(it.removals), sizes=it.sizes.copy())


def to_proto(state: DispatcherState) -> DispatcherSnapshot:
    """The whole of `state` as a message (copies: later changes to `state` do not show)."""
    return DispatcherSnapshot(
        schema_version=SCHEMA_VERSION,
        datasets=[_S.Dataset(dataset_id=d.dataset_id, definition=d.definition)
                  for d in state.datasets.values()],
        dataset_by_fingerprint=[_S.FingerprintEntry(fingerprint=f, dataset_id=d)
                                for f, d in state.dataset_by_fingerprint.items()],
        workers=[_S.Worker(address=w.address, uid=w.uid, index=w.index, host_id=w.host_id,
                           process_id=w.process_id, task_ids=sorted(w.task_ids),
                           data_port=w.data_port, data_socket=w.data_socket)
                 for w in state.workers.values()],
        jobs=[_S.Job(job_id=j.job_id, name=j.name, config=j.config)
              for j in state.jobs.values()],
        job_by_name=[_S.JobNameEntry(name=n, job_id=j) for n, j in state.job_by_name.items()],
        iterations=[_iteration(it) for it in state.iterations.values()],
        iteration_by_key=[_S.IterationKeyEntry(job_id=job_id, repetition=repetition,
                                               iteration_id=iteration_id)
                          for (job_id, repetition), iteration_id
                          in state.iteration_by_key.items()],
        tasks=[_task(t) for t in state.tasks.values()],
        clients=[_S.ClientEntry(client_id=c, iteration_id=i) for c, i in state.clients.items()],
        next_ids=[_S.NextIdEntry(kind=k, next_id=n) for k, n in state.next_ids.items()],
    )


def _split(key: common_pb2.SplitKey) -> tuple[int, int]:
    return key.repetition, key.index


_Config = TypeVar("_Config", common_pb2.DatasetDef, common_pb2.JobConfig)


def _copy(message: _Config) -> _Config:
    copied = type(message)()
    copied.CopyFrom(message)
    return copied


def from_proto(msg: DispatcherSnapshot) -> DispatcherState:
    """The state `msg` holds; UnsupportedSnapshot if it is not a version this code reads."""
    if msg.schema_version == 0:
        raise UnsupportedSnapshot("dispatcher snapshot has no schema version: not a "
                                  "DispatcherSnapshot (a pickled one from an older release?)")
    if msg.schema_version > SCHEMA_VERSION:
        raise UnsupportedSnapshot(
            f"dispatcher snapshot has schema version {msg.schema_version}, newer than the "
            f"{SCHEMA_VERSION} this torch_dataservice reads: it was written by a newer version")
    state = DispatcherState()
    for d in msg.datasets:
        state.datasets[d.dataset_id] = Dataset(d.dataset_id, _copy(d.definition))
    for f in msg.dataset_by_fingerprint:
        state.dataset_by_fingerprint[f.fingerprint] = f.dataset_id
    for w in msg.workers:
        state.workers[w.address] = Worker(
            w.address, w.uid, w.index, w.host_id, w.process_id, task_ids=set(w.task_ids),
            data_port=w.data_port, data_socket=w.data_socket)
    for j in msg.jobs:
        state.jobs[j.job_id] = Job(j.job_id, j.name, _copy(j.config))
    for n in msg.job_by_name:
        state.job_by_name[n.name] = n.job_id
    for it in msg.iterations:
        state.iterations[it.iteration_id] = Iteration(
            it.iteration_id, it.job_id, it.repetition, task_ids=list(it.task_ids),
            client_ids=set(it.client_ids), garbage_collected=it.garbage_collected,
            cursor_repetition=it.cursor_repetition, cursor_index=it.cursor_index,
            ahead=set(it.ahead),
            requeued=[RequeuedSplit(r.split.repetition, r.split.index,
                                    frozenset(r.delivered_offsets)) for r in it.requeued],
            delivered=_delivered(it),
            produced=_produced(it),
            sizes=_sizes(it),
            removals=[(r.round, tuple(r.task_ids)) for r in it.removals],
        )
    for k in msg.iteration_by_key:
        state.iteration_by_key[(k.job_id, k.repetition)] = k.iteration_id
    for t in msg.tasks:
        state.tasks[t.task_id] = Task(
            t.task_id, t.iteration_id, t.worker_address, starting_round=t.starting_round,
            finished=t.finished, lost=t.lost,
            splits={_split(s) for s in t.splits} | set(zip(t.split_repetitions,
                                                            t.split_indices, strict=True)),
            last_split={s.replica: (s.request_id, tuple(_split(k) for k in s.splits))
                        for s in t.last_split},
        )
    for task in state.tasks.values():
        for key in task.splits:
            state.iterations[task.iteration_id].holders.setdefault(key, set()).add(task.task_id)
    for c in msg.clients:
        state.clients[c.client_id] = c.iteration_id
    for i in msg.next_ids:
        state.next_ids[i.kind] = i.next_id
    return state


def _delivered(it: snapshot_pb2.DispatcherSnapshot.Iteration
               ) -> dict[tuple[int, int], set[int]]:
    """The offsets received of each split not settled: messages (schema 3) or columns (4)."""
    delivered = {_split(d.split): set(d.offsets) for d in it.delivered}
    offsets, position = it.delivered_offsets, 0
    for key, count in zip(zip(it.delivered_repetitions, it.delivered_indices, strict=True),
                          it.delivered_offset_counts, strict=True):
        delivered[key] = set(offsets[position:position + count])
        position += count
    if position != len(offsets):
        raise UnsupportedSnapshot(f"iteration {it.iteration_id}: {len(offsets)} delivered "
                                  f"offsets, but the counts add up to {position}")
    return delivered


def _produced(it: snapshot_pb2.DispatcherSnapshot.Iteration) -> dict[tuple[int, int], int]:
    """The element counts of produced splits not settled: messages (3) or columns (4)."""
    produced = {_split(p.split): p.num_elements for p in it.produced}
    produced.update(zip(zip(it.produced_repetitions, it.produced_indices, strict=True),
                        it.produced_elements, strict=True))
    return produced


def _sizes(it: snapshot_pb2.DispatcherSnapshot.Iteration) -> SplitSizes:
    """An iteration's split sizes: runs (version 3), or one entry per split (version 2)."""
    sizes = SplitSizes({_split(p.split): p.num_elements for p in it.sizes})
    for run in it.size_runs:
        sizes.add_run(run.repetition, run.first, run.end, run.num_elements)
    return sizes


def to_bytes(state: DispatcherState) -> bytes:
    return to_proto(state).SerializeToString()


def from_bytes(data: bytes) -> DispatcherState:
    """`from_proto` of serialized bytes; UnsupportedSnapshot if they are not a snapshot."""
    try:
        msg = DispatcherSnapshot.FromString(data)
    except DecodeError as e:
        raise UnsupportedSnapshot(f"dispatcher snapshot does not parse: {e}") from None
    return from_proto(msg)


def snapshot_update(state: DispatcherState) -> Update:
    """An update that, applied (with `apply`) to any state, makes it equal to `state`
    (compaction). It holds a serialized `DispatcherSnapshot`, not a pickle."""
    return snapshot_of(to_proto(state))


def snapshot_of(message: DispatcherSnapshot) -> Update:
    """`snapshot_update` of the state `message` was built from (`to_proto`): the part a
    compaction does off the request path."""
    return Update(snapshot=dispatcher_pb2.StateSnapshot(state=message.SerializeToString()))


def apply(state: DispatcherState, update: Update) -> None:
    """`state.apply(update)`, where a snapshot record replaces the whole state (replay)."""
    if update.WhichOneof("kind") == "snapshot":
        state.replace_with(from_bytes(update.snapshot.state))
    else:
        state.apply(update)

"""Split affinity on a real dispatcher (gRPC), with workers simulated by stubs that heartbeat
and ask for splits as real ones do, their held splits reported by the worker's own HeldReport:
epoch 2's splits go where epoch 1 left them, a worker holding nothing never waits, a journaled
dispatcher restarted mid-epoch still hands every split once, and a dead worker's splits are
requeued. One real WorkerServer pair shows the wiring (its report, sent before its first ask)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

import torch_dataservice as tds
from tests.conftest import free_port, wait_until
from tests.dispatcher.builders import replayed_updates
from torch_dataservice import version
from torch_dataservice.proto import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc
from torch_dataservice.rpc import channel_to
from torch_dataservice.worker.dispatcher_client import HeldReport
from torch_dataservice.worker.task_state import FEED_REPLICA

pb = dispatcher_pb2
pytestmark = pytest.mark.integration
N = 200


class SimWorker:
    """A worker as the dispatcher sees it: heartbeats (with its held splits) and GetSplit."""

    def __init__(self, dispatcher: str, port: int) -> None:
        self.address = f"127.0.0.1:{port}"  # nothing listens: task pushes fail, beats carry
        self.uid = random.getrandbits(60)
        self.held: dict[str, list[int]] = {}
        self.report = HeldReport(lambda: self.held)
        self.tasks: dict[int, int] = {}  # iteration id -> task id
        self.connect(dispatcher)
        self._request_id = 0

    def connect(self, dispatcher: str) -> None:
        self.stub = dispatcher_pb2_grpc.DispatcherServiceStub(channel_to(dispatcher))

    def beat(self) -> None:
        request = pb.WorkerHeartbeatRequest(
            worker_address=self.address, worker_uid=self.uid, current_tasks=self.tasks.values(),
            host_id="sim", process_id=f"sim:{self.address}",
            build=version.to_message(version.current()))
        response = self.report.exchange(
            request, lambda r: self.stub.WorkerHeartbeat(r, timeout=10))
        for task in response.new_tasks:
            self.tasks[task.iteration_id] = task.task_id

    def take(self, iteration_id: int, deadline_s: float = 20) -> int | None:
        """The next split for this worker's task of `iteration_id` (None: end of splits);
        waits (heartbeating) while the dispatcher says requeued splits are not ready."""
        self._request_id += 1
        request = pb.GetSplitRequest(iteration_id=iteration_id, task_id=self.tasks[iteration_id],
                                     replica=FEED_REPLICA, request_id=self._request_id)
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                reply = self.stub.GetSplit(request, timeout=10)
                return None if reply.end_of_splits else reply.split_index
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
                self.beat()


def register(stub) -> str:
    dataset = common_pb2.DatasetDef(pipeline=b"p", splittable=True, num_splits=N,
                                    fingerprint="affinity")
    return stub.GetOrRegisterDataset(pb.GetOrRegisterDatasetRequest(dataset=dataset),
                                     timeout=10).dataset_id


def start_job(stub, dataset_id: str, name: str, workers: list[SimWorker]) -> int:
    job = stub.GetOrCreateJob(pb.GetOrCreateJobRequest(config=common_pb2.JobConfig(
        dataset_id=dataset_id, job_name=name, sharding_policy=1, target_workers="ANY"),
        build=version.to_message(version.current())), timeout=10)
    iteration_id = stub.GetOrCreateIteration(pb.GetOrCreateIterationRequest(
        job_id=job.job_id), timeout=10).iteration_id
    for worker in workers:
        worker.beat()
        assert iteration_id in worker.tasks
    return iteration_id


def run_epoch(iteration_id: int, workers: list[SimWorker], weights: list[float],
              rng: random.Random, until: int | None = None) -> dict[str, list[int]]:
    """Workers ask (each ask by one picked at `weights`, a faster worker asks more often)
    until the splits end, or `until` were handed; what each got."""
    got: dict[str, list[int]] = {w.address: [] for w in workers}
    ended: set[str] = set()
    while len(ended) < len(workers) and (until is None or sum(map(len, got.values())) < until):
        worker = rng.choices(workers, weights)[0]
        if worker.address in ended:
            continue
        index = worker.take(iteration_id)
        if index is None:
            ended.add(worker.address)
        else:
            got[worker.address].append(index)
    return got


def hits(got: dict[str, list[int]], workers: list[SimWorker], dataset_id: str) -> float:
    handed = sum(map(len, got.values()))
    held = sum(len(set(got[w.address]) & set(w.held.get(dataset_id, ()))) for w in workers)
    return held / handed


def start_dispatcher(tmp_path: Path, **options) -> tds.DispatchServer:
    return tds.DispatchServer(tds.DispatcherConfig(
        fault_tolerant_mode=True, work_dir=str(tmp_path), job_gc_timeout_ms=60_000, **options))


@pytest.mark.timeout(120)
def test_epoch_two_goes_where_epoch_one_is_cached_across_a_restart(tmp_path) -> None:
    rng = random.Random(29)
    server = start_dispatcher(tmp_path)
    try:
        stub = dispatcher_pb2_grpc.DispatcherServiceStub(channel_to(server.address))
        dataset_id = register(stub)
        a, b = SimWorker(server.address, free_port()), SimWorker(server.address, free_port())
        workers, weights = [a, b], [0.6, 0.4]  # a is the faster worker, in every epoch
        epoch1 = run_epoch(start_job(stub, dataset_id, "e1", workers), workers, weights, rng)
        for worker in workers:  # what each cached in epoch 1
            worker.held = {dataset_id: epoch1[worker.address]}

        iteration_id = start_job(stub, dataset_id, "e2", workers)  # its beats bring the sets
        before = run_epoch(iteration_id, workers, weights, rng, until=N // 2)
        assert hits(before, workers, dataset_id) >= 0.9, before
        # A journaled dispatcher restarts mid-epoch: what it handed ahead of its cursor is
        # journaled, who holds what (soft) comes back with the next heartbeats.
        server.stop()
        server = start_dispatcher(tmp_path, port=int(server.address.rsplit(":", 1)[1]))
        for worker in workers:
            worker.beat()
        after = run_epoch(iteration_id, workers, weights, rng)
        handed = [i for got in (before, after) for part in got.values() for i in part]
        assert sorted(handed) == list(range(N)), "every split of epoch 2 exactly once"
        assert hits(after, workers, dataset_id) >= 0.9, after

        # A worker that holds nothing joins: it gets a split each time it asks (never waits
        # while the others' cached splits queue), first those nobody holds.
        c = SimWorker(server.address, free_port())
        a.held = {dataset_id: list(range(0, N, 2))}  # b lost its cache: its half is unheld
        b.held = {}
        workers = [a, b, c]
        iteration_id = start_job(stub, dataset_id, "e3", workers)
        epoch3 = run_epoch(iteration_id, workers, [1, 1, 1], rng)
        assert sorted(i for part in epoch3.values() for i in part) == list(range(N))
        assert len(epoch3[c.address]) >= N // 4
        assert all(i % 2 for i in epoch3[c.address][:N // 8]), "unheld ones first"
        assert hits({a.address: epoch3[a.address]}, [a], dataset_id) >= 0.9
    finally:
        server.stop()


@pytest.mark.timeout(120)
def test_a_dead_workers_splits_are_requeued_to_the_others(tmp_path) -> None:
    server = start_dispatcher(tmp_path, worker_timeout_ms=1000)
    try:
        stub = dispatcher_pb2_grpc.DispatcherServiceStub(channel_to(server.address))
        dataset_id = register(stub)
        a, b = SimWorker(server.address, free_port()), SimWorker(server.address, free_port())
        a.held = {dataset_id: list(range(100, 120))}
        iteration_id = start_job(stub, dataset_id, "dies", [a, b])
        died_with = [a.take(iteration_id) for _ in range(5)]
        assert died_with == [100, 101, 102, 103, 104]  # handed ahead of the cursor
        # a stops heartbeating: declared dead, its unsettled splits (all: no reader reported)
        # go back and b takes them, first.
        service = server._service  # noqa: SLF001 - introspection
        wait_until(lambda: (b.beat(), a.address not in service.state.workers)[1], 10,
                   "the silent worker to be removed")
        assert not service._soft.holders  # noqa: SLF001 - its cache went with it
        rest = run_epoch(iteration_id, [b], [1], random.Random(0))[b.address]
        assert sorted(rest[:5]) == died_with
        assert sorted(rest) == list(range(N))
    finally:
        server.stop()


@pytest.mark.timeout(120)
def test_real_workers_report_what_they_hold_before_their_first_ask(tmp_path) -> None:
    """Heartbeats a minute apart: only the report sent before a task's first ask can bring
    the held sets (set after the workers registered) in time."""
    server = start_dispatcher(tmp_path, worker_timeout_ms=120_000)
    held: list[dict[str, list[int]]] = [{}, {}]
    workers = []
    try:
        for index in range(2):
            workers.append(tds.WorkerServer(
                tds.WorkerConfig(server.address, heartbeat_interval_ms=60_000),
                cached_splits=_provider(held, index)))
        # Both in the job from its start: an iteration with one task keeps cursor order.
        wait_until(lambda: len(server._service.state.workers) == 2, 20,  # noqa: SLF001
                   "both workers registered")
        pipeline = tds.Pipeline.range(N * 5).with_split_size(5)
        dataset_id = tds.register_dataset(server.target, pipeline)
        held[0][dataset_id] = list(range(0, N, 2))
        held[1][dataset_id] = list(range(1, N, 2))
        read = list(pipeline.apply(tds.distribute("distributed_epoch", server.target,
                                                  job_name="cached", target_workers="ANY")))
        assert sorted(read) == list(range(N * 5))
        service = server._service  # noqa: SLF001 - introspection
        task_worker = {t.task_id: t.worker_address for t in service.state.tasks.values()}
        holder = {w.address: held[i][dataset_id] for i, w in enumerate(workers)}
        server.stop()  # the journal says which task each split went to
        produced = [u.produce_split for u in replayed_updates(tmp_path)
                    if u.HasField("produce_split") and u.produce_split.split_index >= 0]
        assert len(produced) == N
        # A worker takes every split it holds before any other (it takes others' only when it
        # has none left: how many depends on the two workers' speeds, not on the reports).
        for task_id, address in task_worker.items():
            mine = [p.split_index in holder[address] for p in produced if p.task_id == task_id]
            assert mine and mine[0], f"task {task_id}'s first split was not one it holds"
            assert mine == sorted(mine, reverse=True), (
                f"task {task_id} took a split it holds after one it does not: {mine}")
        at_holder = sum(p.split_index in holder[task_worker[p.task_id]] for p in produced)
        assert at_holder >= 0.5 * N, f"{at_holder} of {N} splits went to their holder"
    finally:
        for worker in workers:
            worker.stop()
        server.stop()


def _provider(held: list[dict[str, list[int]]], index: int) -> Callable[[], dict]:
    return lambda: dict(held[index])

"""Junk and idle connections (issue 24.7): what a peer that never authenticates, or sends
requests nobody can decode, can make a server hold is bounded, and a legitimate reader beside
it reads an epoch exactly once. Servers are CLI subprocesses, so their threads, descriptors
and memory are theirs alone; all traffic stays on loopback."""

from __future__ import annotations

import collections
import os
import random
import re
import socket
import time
from collections.abc import Iterator

import grpc
import pytest

import torch_dataservice as tds
from tests.conftest import HOST, ProcessCluster, ServerProcess
from torch_dataservice.proto import dispatcher_pb2
from torch_dataservice.worker import data_port

pytestmark = [pytest.mark.slow, pytest.mark.integration]
N = 200
IDLE_CONNECTIONS = 1000
JUNK_PER_METHOD = 1000


def threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("Threads:")).split()[1])


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def read_epoch(target: str, job_name: str) -> list[int]:
    pipeline = tds.Pipeline.range(N).apply(tds.distribute(
        "distributed_epoch", target, job_name=job_name, target_workers="ANY"))
    return sorted(int(x) for x in pipeline)


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ProcessCluster, ServerProcess, ServerProcess]]:
    """One dispatcher and one worker for both tests: the junk goes to the dispatcher's gRPC
    port, the idle connections to the worker's data port, and each test reads jobs of its own
    names, so neither sees the other's traffic in what it measures or in the log it counts."""
    cluster = ProcessCluster()
    try:
        dispatcher = cluster.start_dispatcher()
        yield cluster, dispatcher, cluster.start_worker()
    finally:
        cluster.close()


def wait_for(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return predicate()


@pytest.mark.timeout(120)
def test_idle_data_port_connections_are_refused_and_cut(
        servers: tuple[ProcessCluster, ServerProcess, ServerProcess]) -> None:
    """Before: 1,000 idle connections held 1,013 threads and 1,016 descriptors for good."""
    process_cluster, _, worker = servers
    port = int(re.search(r"data port (\d+)", worker.output).group(1))
    pid = worker.proc.pid
    assert read_epoch(process_cluster.target, "warm-up") == list(range(N))
    threads0, fds0 = threads(pid), descriptors(pid)
    idle = []
    try:
        for _ in range(IDLE_CONNECTIONS):
            idle.append(socket.create_connection((HOST, port), timeout=5))
        # At most MAX_HANDSHAKING of them got a thread; the rest were closed as they came.
        assert threads(pid) <= threads0 + data_port.MAX_HANDSHAKING + 10
        # A legitimate reader beside them (it may fall back to gRPC meanwhile).
        assert read_epoch(process_cluster.target, "beside-idle") == list(range(N))
        # Past the handshake deadline, every idle connection is cut, though still open here.
        assert wait_for(lambda: threads(pid) <= threads0 + 5 and descriptors(pid) <= fds0 + 5,
                        data_port.HANDSHAKE_DEADLINE_S + 10), (
            f"threads {threads0} -> {threads(pid)}, descriptors {fds0} -> {descriptors(pid)}")
    finally:
        for sock in idle:
            sock.close()
    assert read_epoch(process_cluster.target, "after-idle") == list(range(N))
    refused = [line for line in worker.lines if "refused a data-port connection" in line]
    cut = [line for line in worker.lines if "cut a data-port connection" in line]
    assert 1 <= len(refused) <= 2 and 1 <= len(cut) <= 2, worker.output[-3000:]


def _junk(rng: random.Random) -> bytes:
    """Bytes that are no protobuf message: a field tag with wire type 7 (none exists)."""
    return b"\xff" + rng.randbytes(rng.randint(0, 64))


@pytest.mark.timeout(180)
def test_malformed_requests_leave_memory_and_log_alone(
        servers: tuple[ProcessCluster, ServerProcess, ServerProcess]) -> None:
    """Before: every undecodable request cost the dispatcher ~15 KB for good (grpcio's path
    for a failing deserializer) and a traceback in its log."""
    process_cluster, dispatcher, _ = servers
    pid = dispatcher.proc.pid
    assert read_epoch(process_cluster.target, "junk-warm-up") == list(range(N))
    rng = random.Random(7)
    service = dispatcher_pb2.DESCRIPTOR.services_by_name["DispatcherService"]
    codes: collections.Counter[str] = collections.Counter()
    with grpc.insecure_channel(dispatcher.address) as channel:
        def flood(count: int) -> None:
            for method in service.methods:
                call = channel.unary_unary(f"/{service.full_name}/{method.name}",
                                           request_serializer=None, response_deserializer=None)
                for _ in range(count):
                    try:
                        call(_junk(rng), timeout=10)
                        codes["OK"] += 1
                    except grpc.RpcError as error:
                        codes[error.code().name] += 1

        flood(100)  # gRPC's own pools and caches settle
        rss0 = rss_mb(pid)
        flood(JUNK_PER_METHOD)
    growth = rss_mb(pid) - rss0
    # Before: ~170 MB for these 11,000 requests.
    assert growth < 25, f"the dispatcher grew by {growth:.0f} MB"
    assert set(codes) == {"INVALID_ARGUMENT"}, codes
    assert read_epoch(process_cluster.target, "after-junk") == list(range(N))
    assert "Exception deserializing" not in dispatcher.output
    malformed = [line for line in dispatcher.lines if "malformed request from" in line]
    assert len(malformed) == 1, dispatcher.output[-3000:]

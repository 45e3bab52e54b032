"""Health and lifecycle: the gRPC health service of both servers, a refused worker exits
non-zero, SIGTERM drains a worker mid-epoch with every element delivered exactly once."""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import torch_dataservice as tds
from tests.conftest import HOST, ProcessCluster, free_port, wait_until
from tests.fault.helpers import Consumer
from torch_dataservice.worker import server as worker_server

pytestmark = pytest.mark.integration

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health(address: str, service: str = "") -> int | None:
    """The health status at `address` (None: nobody answers), with no token, as a probe."""
    with grpc.insecure_channel(address) as channel:
        try:
            return health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2).status
        except grpc.RpcError:
            return None


def slow_identity(x: int) -> int:
    time.sleep(0.001)
    return x


@pytest.mark.timeout(60)
def test_health_follows_registration_and_drain_and_needs_no_token(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="torch_dataservice")
    monkeypatch.setenv("TORCH_DATASERVICE_TOKEN", "health-secret")
    monkeypatch.setattr(worker_server, "REGISTRATION_WAIT_S", 0.3)
    port = free_port()
    options = dict(host=HOST, num_processes=0, heartbeat_interval_ms=100, drain_timeout_s=30)
    # A worker whose dispatcher is not up yet: alive, but not ready.
    leaving = tds.WorkerServer(tds.WorkerConfig(f"{HOST}:{port}", **options))
    servers: list = [leaving]
    try:
        assert health(leaving.address) == NOT_SERVING
        assert health(leaving.address, "liveness") == SERVING  # alive: not to be restarted
        dispatcher = tds.DispatchServer(tds.DispatcherConfig(host=HOST, port=port))
        servers.append(dispatcher)
        assert health(dispatcher.address) == SERVING
        assert health(dispatcher.address, "torch_dataservice.v1.DispatcherService") == SERVING
        wait_until(lambda: health(leaving.address) == SERVING, 10, "the worker to be SERVING")
        assert health(leaving.address, "torch_dataservice.v1.WorkerService") == SERVING
        servers.append(tds.WorkerServer(tds.WorkerConfig(dispatcher.address, **options)))

        # Drained mid-epoch: NOT_SERVING while it serves what it holds, then gone; the
        # other worker serves what it handed back, and every element arrives once.
        n = 3000
        reader = iter(tds.Pipeline.range(n).map(slow_identity).apply(
            tds.distribute("distributed_epoch", dispatcher.target)))
        received = [next(reader) for _ in range(100)]
        draining = threading.Thread(target=leaving.drain)
        draining.start()
        wait_until(lambda: health(leaving.address) == NOT_SERVING, 10, "NOT_SERVING in drain")
        received += list(reader)
        draining.join(30)
        assert not draining.is_alive()
        assert health(leaving.address) is None  # stopped
        assert sorted(received) == list(range(n))
        assert f"worker {leaving.address} left (drained)" in caplog.text
    finally:
        for server in reversed(servers):
            server.stop()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_worker_with_a_wrong_token_exits_non_zero(process_cluster: ProcessCluster) -> None:
    process_cluster.env["TORCH_DATASERVICE_TOKEN"] = "the-fleet-token"
    process_cluster.start_dispatcher()
    process_cluster.env["TORCH_DATASERVICE_TOKEN"] = "another-token"
    worker = process_cluster.spawn(
        "worker", "--dispatcher", process_cluster.dispatcher.address, "--host", HOST,
        "--processes", "0")
    assert worker.wait_exit(60) == 2, worker.output
    errors = [line for line in worker.lines if line.startswith("error:")]
    assert len(errors) == 1 and "refused" in errors[0] and "token" in errors[0], worker.output
    assert "refused a call" in process_cluster.dispatcher.output  # the dispatcher logs it


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_drains_a_worker_mid_epoch_exactly_once(process_cluster: ProcessCluster,
                                                        tmp_path: Path) -> None:
    n = 16_000
    dispatcher = process_cluster.start_dispatcher("--worker-timeout-ms", "2000")
    leaving, staying = (process_cluster.spawn(
        "worker", "--dispatcher", dispatcher.address, "--host", HOST, "--processes", "1",
        "--heartbeat-interval-ms", "100", "--drain-timeout-s", "20") for _ in range(2))
    consumer = Consumer(process_cluster, n, tmp_path / "out.txt", "drain", max_rate=4000,
                        flush_every=64)
    leaving.wait_serving()
    staying.wait_serving()
    assert consumer.wait_received(n // 4, 60), consumer.output()
    leaving.signal(signal.SIGTERM)
    began = time.monotonic()
    assert leaving.wait_exit(40) == 0, leaving.output
    drain_s = time.monotonic() - began
    result = consumer.wait(60)
    assert result.done and result.missing == 0 and result.duplicated == 0, (
        f"{result}\n{consumer.output()}\n{dispatcher.output[-3000:]}")
    assert "draining" in leaving.output and "left the dispatcher" in leaving.output
    assert f"worker {leaving.address} left (drained)" in dispatcher.output
    assert staying.proc.poll() is None
    assert drain_s < 20  # it held a few splits, not the rest of the epoch

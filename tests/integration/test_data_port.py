"""Readers and workers' data ports: which path a read takes, tokens, and a worker dying mid-read."""

from __future__ import annotations

import os
import time

import pytest
import torch

import torch_dataservice as tds
from torch_dataservice import auth
from torch_dataservice.client import data_port as client
from torch_dataservice.client import transports
from torch_dataservice.wire import frame

pytestmark = pytest.mark.integration

SIZES = [20 * 2**20, 0, 1, (1 << 20) - 7, 1 << 20, 100_000, 16 * 2**20]


def element(i: int) -> dict:
    return {"i": i, "data": torch.full((SIZES[i],), i + 1, dtype=torch.uint8)}


def slow_element(i: int) -> torch.Tensor:
    time.sleep(0.05)
    return torch.full((4 << 20,), i % 251, dtype=torch.uint8)


@pytest.fixture
def paths(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The kind of path of every fetch: "unix", "tcp" (data port) or "grpc"."""
    taken: list[str] = []
    pool_fetch = client.DataPortPool.fetch
    assemble = frame.assemble_frame

    def spy_pool(self, target, request, on_header=None):
        taken.append(target[0])
        return pool_fetch(self, target, request, on_header)

    def spy_assemble(messages):
        taken.append("grpc")
        return assemble(messages)

    monkeypatch.setattr(client.DataPortPool, "fetch", spy_pool)
    monkeypatch.setattr(frame, "assemble_frame", spy_assemble)
    return taken


def read_all(target: str, target_workers: str) -> list[dict]:
    pipeline = tds.Pipeline.range(len(SIZES)).map(element).apply(tds.distribute(
        "parallel_epochs", target, compression=None, target_workers=target_workers))
    received = sorted(pipeline, key=lambda e: e["i"])
    assert [e["data"].numel() for e in received] == SIZES
    for e in received:
        assert bool((e["data"] == e["i"] + 1).all())
    return received


@pytest.mark.parametrize(("target_workers", "kind"), [("AUTO", "unix"), ("LOCAL", "unix"),
                                                      ("ANY", "tcp")])
def test_reads_take_the_data_port(cluster_factory, force_grpc: None, paths: list[str],
                                  target_workers: str, kind: str) -> None:
    cluster = cluster_factory(1)
    received = read_all(cluster.target, target_workers)
    received[0]["data"][0] = 0  # decoded tensors are writable
    assert paths and set(paths) == {kind}


def test_workers_without_a_data_port_are_read_over_grpc(
        cluster_factory, force_grpc: None, paths: list[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = cluster_factory(1)
    monkeypatch.setattr(transports, "data_target", lambda info, target_workers: None)
    read_all(cluster.target, "ANY")
    assert paths and set(paths) == {"grpc"}


def test_the_socket_file_goes_with_the_worker(cluster_factory) -> None:
    cluster = cluster_factory(1)
    worker = cluster.workers[0]
    path = worker._data_port.socket_path
    assert os.path.exists(path)
    cluster.stop_worker(worker)
    assert not os.path.exists(path)


def test_reads_with_a_token(cluster_factory, force_grpc: None, paths: list[str],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(auth.TOKEN_ENV, "data-port-secret")
    cluster = cluster_factory(1)  # new ports: no cached channel without the token
    for target_workers, kind in (("AUTO", "unix"), ("ANY", "tcp")):
        paths.clear()
        read_all(cluster.target, target_workers)
        assert set(paths) == {kind}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("target_workers", ["AUTO", "ANY"])
def test_a_worker_killed_mid_read_is_skipped(process_cluster, target_workers: str) -> None:
    n = 40
    process_cluster.start_dispatcher("--worker-timeout-ms", "1500")
    victim, _ = process_cluster.start_workers(2)
    pipeline = tds.Pipeline.range(n).map(slow_element).apply(tds.distribute(
        "parallel_epochs", process_cluster.target, compression=None,
        target_workers=target_workers))
    values: list[int] = []
    for tensor in pipeline:  # a read that never skips the dead worker fails at the timeout
        values.append(int(tensor[0]))
        if len(values) == 6:
            victim.kill()  # mid-read: its connections break, its socket is left behind
    # Each worker makes the whole range (OFF): the survivor's copy is complete.
    assert set(values) == set(range(n)) and len(values) >= n

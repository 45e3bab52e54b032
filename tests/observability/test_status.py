"""`torch-dataservice status` against a running cluster, through the CLI as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

import torch_dataservice as tds
from tests.conftest import REPO, subprocess_env
from torch_dataservice.observability.status_text import as_text
from torch_dataservice.proto import status_pb2


def status(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torch_dataservice", "status", *args],
                          capture_output=True, text=True, timeout=30, cwd=str(REPO),
                          env=subprocess_env())


def _slow(x: int) -> int:
    time.sleep(0.01)
    return x


@pytest.mark.timeout(60)
def test_status_lists_the_workers_iterations_and_clients_of_a_running_cluster(shared_cluster):
    cluster = shared_cluster
    pipeline = tds.Pipeline.range(400).map(_slow).apply(
        tds.distribute("distributed_epoch", cluster.target, job_name="status-view"))
    iterator = iter(pipeline)
    for _ in range(20):
        next(iterator)
    time.sleep(0.6)  # two heartbeats apart: rates
    text = status("--dispatcher", cluster.address)
    as_json = status("--dispatcher", f"grpc://{cluster.address}", "--json")
    for _ in iterator:
        pass

    assert text.returncode == 0, text.stderr
    for worker in cluster.workers:
        assert worker.address in text.stdout
    assert "status-view" in text.stdout and "running" in text.stdout
    assert "CLIENTS (" in text.stdout and "WAIT/BATCH" in text.stdout
    reply = json.loads(as_json.stdout)
    assert {w["address"] for w in reply["workers"]} == {w.address for w in cluster.workers}
    (iteration,) = [i for i in reply["iterations"] if i["job_name"] == "status-view"]
    assert iteration["mode"] == "DYNAMIC" and iteration["clients"] == 1
    assert 0 < int(iteration["splits_done"]) <= int(iteration["splits_handed"])
    assert int(iteration["elements_delivered"]) >= 20
    (client,) = [c for c in reply["clients"] if c["iteration_id"] == iteration["iteration_id"]]
    assert int(client["batches"]) >= 20 and client["rank"] == 0
    assert any(float(w["elements_per_s"]) > 0 for w in reply["workers"])


@pytest.mark.integration
@pytest.mark.timeout(30)
def test_status_of_a_dispatcher_that_is_not_there_fails_fast_and_says_so():
    started = time.monotonic()
    result = status("--dispatcher", "127.0.0.1:1")
    assert result.returncode == 2
    assert "dispatcher 127.0.0.1:1 did not answer" in result.stderr
    assert time.monotonic() - started < 20


@pytest.mark.timeout(10)
def test_status_text_aligns_columns_and_gives_rates_units() -> None:
    reply = status_pb2.GetClusterStatusResponse(uptime_s=75, version="0.1.0", protocol="1")
    reply.workers.add(address="10.0.0.1:5001", state="up", heartbeat_age_s=0.2, tasks=1,
                      elements_per_s=1234.5, bytes_per_s=2.5e6, elements_sent=10_000,
                      cache_bytes=3_000_000, cache_hits=97, cache_misses=3, cache_evictions=2)
    reply.workers.add(address="10.0.0.22:5001", state="late", heartbeat_age_s=6.0)
    text = as_text(reply, "d:5000")
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("ADDRESS"))
    rows = lines[header:header + 3]
    assert len({row.index("STATE") if "STATE" in row else row.index(s)
                for row, s in zip(rows, ["STATE", "up", "late"], strict=True)}) == 1
    assert "1,234/s" in text and "2.5 MB/s" in text and "up 1m15s" in text
    assert "ITERATIONS (0): none" in text
    assert "CACHE" in lines[header] and "3.0 MB 97% hits 2 evicted" in rows[1]
    assert rows[2].rstrip().endswith("-")  # no cache

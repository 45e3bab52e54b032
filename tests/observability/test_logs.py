"""Logs that help: lifecycle events, JSON lines, and a reader that says what it waits for."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time

import pytest

import torch_dataservice as tds
from tests.conftest import REPO, free_port, subprocess_env
from torch_dataservice.observability.logs import JsonFormatter
from torch_dataservice.observability.waiting import Waiting, describe

READER = "torch_dataservice.client.reader"


def _read(target: str, n: int) -> list[int]:
    return list(tds.Pipeline.range(n).apply(tds.distribute("distributed_epoch", target)))


@pytest.mark.timeout(60)
def test_a_reader_without_workers_warns_within_its_deadline(cluster_factory, monkeypatch,
                                                            caplog):
    monkeypatch.setenv("TORCH_DATASERVICE_WAIT_WARNING_S", "0.5")
    cluster = cluster_factory(0)
    iterator = iter(tds.Pipeline.range(10).apply(
        tds.distribute("distributed_epoch", cluster.target)))
    caplog.set_level(logging.INFO)
    started = time.monotonic()
    found: list = []
    threading.Thread(target=lambda: found.append(next(iterator, None)), daemon=True).start()
    while time.monotonic() - started < 10 and not any(
            r.name == READER and r.levelno == logging.WARNING for r in caplog.records):
        time.sleep(0.05)
    warnings = [r.getMessage() for r in caplog.records
                if r.name == READER and r.levelno == logging.WARNING]
    assert warnings, "no warning within 10 s"
    assert time.monotonic() - started < 5  # the deadline was 0.5 s
    assert "first element" in warnings[0]
    assert f"no worker has registered with the dispatcher at {cluster.address}" in warnings[0]
    cluster.add_worker(num_processes=0)  # then it reads
    deadline = time.monotonic() + 30
    while not found and time.monotonic() < deadline:
        time.sleep(0.05)
    assert found == [0]


@pytest.mark.timeout(30)
def test_an_unreachable_dispatcher_is_reported_while_retrying_never_as_a_false_timeout(
        monkeypatch, caplog):
    monkeypatch.setenv("TORCH_DATASERVICE_WAIT_WARNING_S", "0.5")
    monkeypatch.setenv("TORCH_DATASERVICE_CONNECT_TIMEOUT_S", "2")
    caplog.set_level(logging.WARNING)
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(Exception) as info:
        _read(address, 3)
    retrying = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert retrying and address in retrying[0] and "s so far" in retrying[0]
    message = str(info.value)
    assert "no answer after 2." in message  # the time it really waited


@pytest.mark.timeout(10)
def test_wait_descriptions_name_what_is_missing() -> None:
    assert describe(Waiting("d:1", 2000, dispatcher_down_s=31)) == (
        "dispatcher d:1 unreachable, retrying (31 s so far)")
    assert "no worker has registered with the dispatcher at d:1" in describe(
        Waiting("d:1", 2000, workers_registered=0))
    assert "worker w:2 (via tcp:w:99) unreachable" in describe(
        Waiting("d:1", 2000, unreachable=["worker w:2 (via tcp:w:99)"]))


@pytest.mark.timeout(10)
def test_json_log_lines_are_one_object_each() -> None:
    record = logging.LogRecord("torch_dataservice.x", logging.INFO, __file__, 1,
                               "worker %s joined", ("h:1",), None)
    entry = json.loads(JsonFormatter().format(record))
    assert entry["message"] == "worker h:1 joined" and entry["level"] == "INFO"
    assert entry["logger"] == "torch_dataservice.x" and entry["time"].endswith("Z")


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_a_dispatcher_logs_lifecycle_events_once_as_json(tmp_path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch_dataservice", "--log-format", "json", "dispatcher",
         "--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, cwd=str(REPO), env=subprocess_env())
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("dispatcher")
        worker = tds.WorkerServer(tds.WorkerConfig(f"127.0.0.1:{port}", host="127.0.0.1",
                                                   num_processes=0))
        try:
            assert _read(f"127.0.0.1:{port}", 5) == list(range(5))
        finally:
            worker.stop()
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    entries = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    messages = [e["message"] for e in entries]
    assert len(entries) == len(err.splitlines())  # every line is one JSON object
    for event in ("joined (index -1", "created (dataset", "client 3000 joined iteration",
                  "client 3000 of iteration 2000 left", "iteration 2000 finished"):
        assert sum(event in m for m in messages) == 1, (event, messages)

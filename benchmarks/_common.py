"""Shared by the benchmark scripts: this checkout on the import path, a free port, an environment
for child pythons, CLI servers started as subprocesses, and a service in this process.

A script imports it first (`from _common import ...`: scripts run as `python benchmarks/X.py`,
so this directory is on sys.path); importing it makes `torch_dataservice` importable from the
checkout without installing it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
if ROOT not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, ROOT)

import torch_dataservice as tds  # noqa: E402

HOST = "127.0.0.1"


def free_port() -> int:
    """A port nothing listens on right now (bound to 0 on HOST, then closed)."""
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def child_env(*paths: str, **extra: str) -> dict[str, str]:
    """The environment for a child python that imports this checkout (and `paths`)."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (ROOT, *paths, os.environ.get("PYTHONPATH", "")) if p)
    return env


def spawn_server(args: Sequence[str], env: dict[str, str] | None = None,
                 log_level: str = "WARNING", **popen: Any) -> tuple[subprocess.Popen, str]:
    """`python -m torch_dataservice ARGS` once it printed 'serving at ADDRESS': (process,
    ADDRESS without grpc://). A server that prints anything else first is killed. It runs in
    this checkout's root: `python -m` imports the package from its working directory before
    PYTHONPATH, so a benchmark of another checkout run from this one would time this one's."""
    popen.setdefault("cwd", ROOT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch_dataservice", "--log-level", log_level, *args],
        stdout=subprocess.PIPE, text=True, env=env or child_env(), **popen)
    line = proc.stdout.readline() if proc.stdout else ""
    if " serving at " not in line:
        proc.kill()
        proc.wait(15)
        raise RuntimeError(f"{args[0]} did not start: {line!r}")
    return proc, line.split(" serving at ", 1)[1].strip().removeprefix("grpc://")


def stop_servers(procs: Sequence[subprocess.Popen], timeout_s: float = 15.0) -> None:
    """SIGTERM each (the last started first), then wait; SIGKILL one that does not exit."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in reversed(procs):
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextlib.contextmanager
def local_cluster(processes: int = 1, workers: int = 1, heartbeat_interval_ms: int | None = None,
                  **dispatcher_options: Any) -> Iterator[tds.DispatchServer]:
    """A dispatcher and `workers` workers of `processes` executor processes each, in this
    process on HOST; stopped at exit."""
    worker_options = {} if heartbeat_interval_ms is None else {
        "heartbeat_interval_ms": heartbeat_interval_ms}
    dispatcher = tds.DispatchServer(tds.DispatcherConfig(host=HOST, **dispatcher_options))
    servers: list[tds.WorkerServer] = []
    try:
        for _ in range(workers):
            servers.append(tds.WorkerServer(tds.WorkerConfig(
                dispatcher.address, host=HOST, num_processes=processes, **worker_options)))
        yield dispatcher
    finally:
        for server in servers:
            server.stop()
        dispatcher.stop()

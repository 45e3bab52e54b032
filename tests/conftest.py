"""Shared fixtures: clusters of real servers on loopback, in this process or as subprocesses.

- `cluster_factory(num_workers=2, ...)`: a `DispatchServer` and N `WorkerServer`s in this
  process on ephemeral 127.0.0.1 ports (stopped at teardown). `shared_cluster` is one such
  cluster shared by the whole session (tests on it must use their own job names).
- `process_cluster`: dispatcher and workers started through the CLI
  (`python -m torch_dataservice ...`) as subprocesses; any of them can be SIGKILLed,
  SIGTERMed or restarted on the same port; every child is killed at teardown.
- `force_grpc`: in-process readers normally skip gRPC for workers of their own process; this
  makes them go over the wire like a remote trainer.

Helpers importable by tests: `free_port()`, `wait_until(predicate, timeout_s, what)`.

The `integration` marker (docs/development.md): a test that starts servers or processes carries
it, so that `pytest -m "not integration"` is a loop of seconds. Tests using one of
SERVER_FIXTURES get it here; any other test that starts a gRPC server, a subprocess or a fork
without it fails, naming what it started (`_no_servers`).
"""

from __future__ import annotations

import contextlib
import multiprocessing.process
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import pytest

import torch_dataservice as tds

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
SERVE_DEADLINE_S = 60.0  # a loaded CI machine imports torch slowly


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections (Linux: 32768 by default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            return int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_ports = random.Random()  # seeded from the OS: xdist's processes draw apart


def free_port() -> int:
    """A port nothing is bound to right now, below the kernel's ephemeral range.

    A server started with it binds seconds later (it imports torch first). A port from the
    ephemeral range (what binding port 0 gives) may meanwhile become the source port of an
    outgoing connection of another test, and the server fails with "Address already in use"
    (seen in a full suite run); below the range only another bind can take it.
    """
    high = max(2048, _ephemeral_low())
    for _ in range(200):
        port = _ports.randrange(max(1024, high - 12000), high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((HOST, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {high} in 200 tries")


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str,
               interval_s: float = 0.02) -> Any:
    """Poll `predicate` until it returns something truthy; fail the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a child python that imports torch_dataservice from this checkout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TORCH_DATASERVICE_CONNECT_TIMEOUT_S", "30")
    env.update(extra)
    return env


# ---------------------------------------------------------------------- the integration marker
# Fixtures that start servers or processes: a test using one is an integration test.
SERVER_FIXTURES = frozenset({
    "cluster_factory", "shared_cluster", "process_cluster",  # this file
    "cluster",  # tests/torch/conftest.py and modules of tests/integration
    "fleet",  # tests/fleet/conftest.py
})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SERVER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.integration)
    # The longest groups first: the fleet tests (minutes, one process), then the fault tests
    # (real processes killed and restarted), then the other modules with a slow test (torchrun,
    # CLI servers); the many short modules last, to even out the two processes' ends. Run
    # last, a long group leaves the other process idle at the end (the scheduler below hands
    # out groups in this order).
    slow = {run_group(item.nodeid) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: _start_rank(item.nodeid, slow))


def _start_rank(nodeid: str, slow_groups: Collection[str] = ()) -> int:
    group = run_group(nodeid)
    if group == "fleet":
        return 0
    if nodeid.startswith("tests/fault/"):
        return 1
    return 2 if group in slow_groups else 3


def run_group(nodeid: str) -> str:
    """Under `make test`'s `-n 2 --dist loadscope`, the tests of one group run in one
    process, one after another: a module's (its module-scoped clusters start once), and every
    fleet test's (tests/fleet/: a fleet takes gigabytes and both cores' worth of servers)."""
    module = nodeid.split("::", 1)[0]
    return "fleet" if module.startswith("tests/fleet/") else module


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's scope scheduling, with `run_group` as the scope. (Its own loadgroup
    marks name the group in a test's node id, which pytest 9.2 no longer lets a plugin
    change: every test was scheduled alone, a module's clusters started twice, and two fleets
    ran at once.)"""
    if config.getvalue("dist") not in ("loadscope", "loadgroup"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class RunGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return run_group(nodeid)

    config.option.loadscopereorder = False  # our order (above), not by number of tests
    return RunGroups(config, log)


def _refuse(what: str) -> Callable[..., Any]:
    def refused(*args: Any, **kwargs: Any) -> Any:
        pytest.fail(f"this test starts {what} but is not marked integration: add "
                    "`pytestmark = pytest.mark.integration` to its module (or "
                    "@pytest.mark.integration to it); see docs/development.md", pytrace=False)
    return refused


@contextlib.contextmanager
def _no_servers(item: pytest.Item) -> Iterator[None]:
    """While a test without the integration marker sets up or runs, starting a gRPC server, a
    subprocess or a process fails it: the marker's promise is kept by construction."""
    if item.get_closest_marker("integration") is not None:
        yield
        return
    import grpc

    patches = [(grpc, "server", "a gRPC server"), (os, "fork", "a forked process"),
               (subprocess.Popen, "__init__", "a subprocess"),
               (multiprocessing.process.BaseProcess, "start", "a process")]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, what in patches:
        setattr(owner, name, _refuse(what))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Any:
    with _no_servers(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Any:
    with _no_servers(item):
        return (yield)


# ---------------------------------------------------------------------- in-process clusters
class Cluster:
    """A dispatcher and workers in this process. `target` is what readers pass as `service`."""

    def __init__(self, dispatcher_config: tds.DispatcherConfig, worker_defaults: dict) -> None:
        self._worker_defaults = worker_defaults
        self.dispatcher = tds.DispatchServer(dispatcher_config)
        self.workers: list[tds.WorkerServer] = []

    @property
    def target(self) -> str:
        return self.dispatcher.target

    @property
    def address(self) -> str:
        return self.dispatcher.address

    def add_worker(self, **overrides: Any) -> tds.WorkerServer:
        options = {**self._worker_defaults, **overrides}
        worker = tds.WorkerServer(tds.WorkerConfig(self.address, **options))
        self.workers.append(worker)
        return worker

    def stop_worker(self, worker: tds.WorkerServer) -> None:
        worker.stop()
        self.workers.remove(worker)

    def stop(self) -> None:
        for worker in self.workers:
            worker.stop()
        self.workers.clear()
        self.dispatcher.stop()


def _make_cluster(num_workers: int = 2, *, num_processes: int = 1,
                  heartbeat_interval_ms: int | None = 100, worker_timeout_ms: int | None = None,
                  **dispatcher_options: Any) -> Cluster:
    cluster = Cluster(
        tds.DispatcherConfig(host=HOST, worker_timeout_ms=worker_timeout_ms,
                             **dispatcher_options),
        dict(host=HOST, num_processes=num_processes,
             heartbeat_interval_ms=heartbeat_interval_ms))
    try:
        for _ in range(num_workers):
            cluster.add_worker()
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture
def cluster_factory() -> Iterator[Callable[..., Cluster]]:
    """`cluster_factory(num_workers=2, num_processes=1, heartbeat_interval_ms=100,
    worker_timeout_ms=None, **DispatcherConfig options)` -> a started Cluster."""
    clusters: list[Cluster] = []

    def make(*args: Any, **kwargs: Any) -> Cluster:
        cluster = _make_cluster(*args, **kwargs)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.stop()


@pytest.fixture(scope="session")
def shared_cluster() -> Iterator[Cluster]:
    """Two workers shared by every test of the session (starting executors costs seconds).

    Tests on it must use job names of their own and must not stop or break its servers.
    """
    cluster = _make_cluster(2)
    yield cluster
    cluster.stop()


@pytest.fixture
def force_grpc(monkeypatch: pytest.MonkeyPatch) -> None:
    """Readers of this process fetch over gRPC even from workers of this process."""
    from torch_dataservice.wire import inprocess as local

    monkeypatch.setattr(local, "lookup", lambda address: None)


@pytest.fixture
def fast_connect_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls that find nobody listening give up after a few seconds instead of a minute."""
    monkeypatch.setenv("TORCH_DATASERVICE_CONNECT_TIMEOUT_S", "1")


# ---------------------------------------------------------------------- subprocess clusters
class ServerProcess:
    """One `python -m torch_dataservice ...` child; its output is collected line by line."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.args = args
        self._env = env
        self.proc: subprocess.Popen[str]
        self.lines: list[str] = []
        self.address = ""
        self._line_came = threading.Event()  # set by each line collected
        self._start()

    def _start(self) -> None:
        self.lines = []
        self.address = ""
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch_dataservice", *self.args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            text=True, env=self._env, cwd=str(REPO), start_new_session=True)
        self._follow()

    def _follow(self) -> None:
        """Collect the started process's output lines (in a thread)."""
        threading.Thread(target=self._collect, args=(self.proc, self.lines, self._line_came),
                         daemon=True).start()

    @staticmethod
    def _collect(proc: subprocess.Popen[str], lines: list[str], came: threading.Event) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            came.set()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_serving(self, timeout_s: float = SERVE_DEADLINE_S) -> str:
        """Wait for the 'serving at ADDRESS' line; returns ADDRESS (without grpc://)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._line_came.clear()  # a line collected from now on ends the wait below
            for line in list(self.lines):
                if line.startswith(("dispatcher serving at ", "worker serving at ")):
                    self.address = line.split(" serving at ", 1)[1].split()[0].removeprefix(
                        "grpc://")
                    return self.address
            if self.proc.poll() is not None:
                pytest.fail(f"{self.args[0]} exited with {self.proc.returncode} before serving:"
                            f"\n{self.output}")
            self._line_came.wait(0.05)
        pytest.fail(f"{self.args[0]} did not print 'serving at' within {timeout_s}s:\n"
                    f"{self.output}")

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def wait_exit(self, timeout_s: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.args[0]} did not exit within {timeout_s}s:\n{self.output}")

    def kill(self) -> None:
        """SIGKILL the server and everything it started (its executor processes)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def restart(self) -> str:
        """Start the same command again (same port when it was explicit) and wait for it."""
        if self.proc.poll() is None:
            self.kill()
        self._start()
        return self.wait_serving()


class ProcessCluster:
    """Servers as CLI subprocesses. Workers get an explicit free port so restarts keep it."""

    def __init__(self) -> None:
        self.processes: list[ServerProcess] = []
        self.env = subprocess_env()
        self.dispatcher: ServerProcess | None = None

    def spawn(self, *args: str) -> ServerProcess:
        """Start `python -m torch_dataservice ARGS` without waiting for it."""
        process = ServerProcess(list(args), self.env)
        self.processes.append(process)
        return process

    def start_dispatcher(self, *extra: str, port: int | None = None) -> ServerProcess:
        process = self.spawn("dispatcher", "--host", HOST, "--port", str(port or free_port()),
                             *extra)
        process.wait_serving()
        self.dispatcher = process
        return process

    @property
    def target(self) -> str:
        assert self.dispatcher is not None, "start_dispatcher() first"
        return f"grpc://{self.dispatcher.address}"

    def start_worker(self, *extra: str, port: int | None = None,
                     processes: int = 1) -> ServerProcess:
        process = self._spawn_worker(port or free_port(), processes, extra)
        process.wait_serving()
        return process

    def start_workers(self, count: int, *extra: str, processes: int = 1) -> list[ServerProcess]:
        """`count` workers started at once, then waited for: each spends seconds importing
        torch, and they do it side by side instead of one after the other."""
        ports: set[int] = set()
        while len(ports) < count:
            ports.add(free_port())
        started = [self._spawn_worker(port, processes, extra) for port in ports]
        for process in started:
            process.wait_serving()
        return started

    def _spawn_worker(self, port: int, processes: int, extra: tuple[str, ...]) -> ServerProcess:
        assert self.dispatcher is not None, "start_dispatcher() first"
        return self.spawn("worker", "--dispatcher", self.dispatcher.address, "--host", HOST,
                          "--port", str(port), "--processes", str(processes),
                          "--heartbeat-interval-ms", "100", *extra)

    def close(self) -> None:
        for process in self.processes:
            process.kill()
            if process.proc.stdout is not None:
                process.proc.stdout.close()


@pytest.fixture
def process_cluster() -> Iterator[ProcessCluster]:
    cluster = ProcessCluster()
    try:
        yield cluster
    finally:
        cluster.close()

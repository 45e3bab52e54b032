"""Which service a DataLoader reads from, and the one started for this process if none is given.

`service=None` reads `TORCH_DATASERVICE_ADDRESS`; if that is unset too, a dispatcher and one
worker (on loopback only) start when the first loader is built (or first needs them), in a
process of their own (the embedded service), and stop when this process exits; if it dies,
they see their connection close and stop. The switch to a shared fleet is one line:
`export TORCH_DATASERVICE_ADDRESS=HOST:PORT` (or `service="grpc://HOST:PORT"`).

Why not in this process: a gRPC server always has a thread inside gRPC, so at every fork of a
process that runs one, gRPC skips its fork handlers ("Other threads are currently calling into
gRPC, skipping fork() handlers" on stderr) and the child inherits gRPC's state mid-call. With
the servers here, a training script could not fork after its first epoch: torch's own
DataLoader workers died of SIGSEGV, and so could a multiprocessing fork pool. This process
keeps only gRPC clients, whose calls hold a fork off until they end (fork_gate.py).

The service process is forked from this process's executor fork server (worker/launch.py:
torch imported, no gRPC, forked from the training script when its first loader is built), or
is a fresh interpreter where forking is off; it forks a fork server of its own for its
worker's executors before it starts gRPC. Its readers reach the worker's data port on its Unix
socket. Where that fork server could be forked, the service is forked from it at once, when the
first loader is built, and waited for only when a loader first needs it: its start (imports,
servers, executors: a few hundred milliseconds) overlaps what the script does before its first
epoch (building the model, loading a checkpoint) instead of delaying the first batch.

Under torchrun every rank starts its own embedded service, with the host's cores divided among
the local ranks: no rank depends on another's lifetime.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from torch_dataservice.rpc import wait_report_s
from torch_dataservice.torch.distributed import local_world_size

logger = logging.getLogger(__name__)

ADDRESS_ENV = "TORCH_DATASERVICE_ADDRESS"
SERVICE_MAIN = "torch_dataservice.torch.embedded:serve"
# How long the service process may take to stop its worker and dispatcher before it is killed.
STOP_TIMEOUT_S = 30.0


@dataclass
class _Service:
    """This process's handle on its embedded service process."""

    process: Any  # launch.ExecutorProcess
    conn: Connection
    target: str | None = None  # None until the service said it serves (_wait_ready)


_lock = threading.Lock()
_service: _Service | None = None


def resolve(service: object) -> tuple[object, bool]:
    """(service to read from, whether it is this process's embedded one)."""
    if service is not None:
        return service, False
    address = os.environ.get(ADDRESS_ENV)
    if address:
        return address, False
    return None, True


def embedded_target() -> str:
    """`grpc://HOST:PORT` of this process's embedded dispatcher, once it serves: started on
    first call unless `prepare` started it (and again if it exited after serving)."""
    global _service
    with _lock:
        if _service is not None and _service.target is not None and _service.process.wait(0):
            # Killed (the OOM killer?): the epochs under way are lost, the next ones need not be.
            logger.warning("the embedded service (pid %d) exited; starting another",
                           _service.process.pid)
            _service.conn.close()
            _service = None
        if _service is None:
            _service = _launch()
        if _service.target is None:
            try:
                _service.target = _wait_ready(_service.conn, _service.process.pid)
            except BaseException:
                service, _service = _service, None
                service.conn.close()
                service.process.kill()
                service.process.wait(5)
                raise
        return _service.target


def prepare() -> None:
    """When a loader is built: start this process's executor fork server if this process can
    simply fork it (worker/launch.py: no other thread runs yet, as when a training script
    builds its first loader), and fork the service from it now, without waiting for it
    (module docstring). Otherwise both start when a loader first needs the service, the fork
    server as a fresh interpreter that imports torch: the first batch then waits."""
    from torch_dataservice.worker import launch

    global _service
    with _lock:
        if _service is None and launch.start_fork_server_here(after_torch_ops=True):
            _service = _launch()


def _launch() -> _Service:
    """Start the service process (with _lock held); it says when it serves (_wait_ready)."""
    from torch_dataservice.worker import launch

    launch.start_fork_server_here(after_torch_ops=True)  # before gRPC runs (see prepare)
    num_processes = None
    if local_world_size() > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        num_processes = max(1, cores // local_world_size())
    script = sys.argv[0] if sys.argv and sys.argv[0] else ""
    script_dir = os.path.dirname(os.path.abspath(script)) if os.path.isfile(script) else ""
    ours, theirs = socket.socketpair()
    with theirs:
        try:
            process = launch.start_process(theirs.fileno(), SERVICE_MAIN, {
                "num_processes": num_processes, "script_dir": script_dir,
                "inherited_pool": launch.shared_fork_server().forked_with_threads})
        except BaseException:
            ours.close()
            raise
    atexit.unregister(shutdown)  # once, however many it started
    atexit.register(shutdown)
    return _Service(process, Connection(ours.detach()))


def _wait_ready(conn: Connection, pid: int) -> str:
    """The service's dispatcher target, once it serves (it may first wait for a fork server's
    imports, then for its executors': minutes on an overloaded host)."""
    from torch_dataservice.worker import launch

    timeout = 2 * launch.FORK_TIMEOUT_S
    started = time.monotonic()
    while not conn.poll(min(wait_report_s(), max(0.0, started + timeout - time.monotonic()))):
        waited = time.monotonic() - started
        if waited >= timeout:
            raise TimeoutError(f"the embedded service (pid {pid}) did not start within "
                               f"{timeout:.0f}s")
        logger.warning("waiting for the embedded service (pid %d) to start: %.0f s so far",
                       pid, waited)
    try:
        kind, text = conn.recv()
    except (EOFError, OSError):
        raise RuntimeError(f"the embedded service (pid {pid}) exited before it served: its "
                           "stderr says why") from None
    if kind != "ready":
        raise RuntimeError(f"the embedded service (pid {pid}) could not start:\n{text}")
    return text


def shutdown() -> None:
    """Stop the embedded service (registered at exit; safe to call twice)."""
    global _service
    with _lock:
        service, _service = _service, None
    if service is None:
        return
    # Readers first: their iterations are released while the service still answers.
    from torch_dataservice.torch import loader_iter

    loader_iter.close_all()
    try:
        service.conn.send("stop")  # not only EOF: a forked child may hold a copy of the socket
    except (OSError, ValueError):
        pass  # it is gone already
    service.conn.close()
    if not service.process.wait(STOP_TIMEOUT_S):
        logger.warning("the embedded service (pid %d) did not stop within %.0f s; killing it",
                       service.process.pid, STOP_TIMEOUT_S)
        service.process.kill()
        service.process.wait(5)


def _after_fork_in_child() -> None:
    """A fork (torch's DataLoader workers, a multiprocessing pool) does not own the parent's
    service: it drops its copy of the connection, so that the service stops when the parent
    is gone even while the child lives; a loader in the child starts a service of its own."""
    global _lock, _service
    _lock = threading.Lock()
    service, _service = _service, None
    if service is not None:
        service.conn.close()  # this process's copy only: the socket is not shut down


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# ---------------------------------------------------------------------- in the service process
def serve(conn: Connection, num_processes: int | None, script_dir: str,
          inherited_pool: bool) -> None:
    """The embedded service process: a dispatcher and a worker on loopback until the trainer
    says stop or its connection closes. `inherited_pool`: forked from a fork server that may
    carry torch's OpenMP pool (worker/launch.py)."""
    # The one function above client/ that composes servers (the floors test allows it).
    from torch_dataservice.config import WorkerConfig
    from torch_dataservice.dispatcher.server import DispatchServer
    from torch_dataservice.worker import launch
    from torch_dataservice.worker.server import WorkerServer

    # Ctrl-C reaches the whole process group: the trainer decides when the service ends (its
    # readers release their iterations first).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    launch.start_fork_server_here(inherited_pool=inherited_pool)  # before gRPC runs
    # Executors may be fresh interpreters: let them import what the training script imports
    # from its own directory (a dataset module next to train.py), as torch's spawned workers
    # can.
    if script_dir:
        saved = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([script_dir] + ([saved] if saved else []))
    try:
        dispatcher = DispatchServer()
        try:
            worker = WorkerServer(WorkerConfig(dispatcher.address, num_processes=num_processes))
        except BaseException:
            dispatcher.stop()
            raise
    except Exception:
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", dispatcher.target))
    try:
        conn.recv()  # "stop", or EOF: the trainer is gone
    except (EOFError, OSError):
        pass
    worker.stop()
    dispatcher.stop()

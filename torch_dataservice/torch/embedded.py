"""Which service a DataLoader reads from, and the one started in this process if none is given.

`service=None` reads `TORCH_DATASERVICE_ADDRESS`; if that is unset too, this process starts a
dispatcher and one worker (on loopback only) the first time a loader needs them and stops them
at exit. The switch to a shared fleet is one line: `export TORCH_DATASERVICE_ADDRESS=HOST:PORT`
(or `service="grpc://HOST:PORT"`).

Under torchrun every rank starts its own embedded service, with the host's cores divided among
the local ranks: no rank depends on another's lifetime.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading

from torch_dataservice.torch.distributed import local_world_size

ADDRESS_ENV = "TORCH_DATASERVICE_ADDRESS"

_lock = threading.Lock()
_servers: tuple | None = None


def resolve(service: object) -> tuple[object, bool]:
    """(service to read from, whether it is this process's embedded one)."""
    if service is not None:
        return service, False
    address = os.environ.get(ADDRESS_ENV)
    if address:
        return address, False
    return None, True


def embedded_target() -> str:
    """`grpc://HOST:PORT` of this process's embedded dispatcher, started on first call."""
    global _servers
    with _lock:
        if _servers is None:
            _servers = _start()
            # Before concurrent.futures' own exit hook (threading's atexit runs in reverse
            # order, ahead of atexit's): it would refuse the servers' gRPC threads new work
            # and leave calls in flight hanging until their deadlines.
            threading._register_atexit(shutdown)  # type: ignore[attr-defined]
            atexit.register(shutdown)
        return _servers[0].target


def prepare() -> None:
    """Start the embedded worker's executor fork server now if this process can simply fork
    it (worker/launch.py: no other thread runs yet, as when a training script builds its
    first loader); else it starts with the worker. Once gRPC or torch's thread pool runs it
    must be a fresh interpreter that imports torch: the first batch then waits seconds."""
    from torch_dataservice.worker import launch

    with _lock:
        if _servers is None:
            launch.start_fork_server_here(after_torch_ops=True)


def _start() -> tuple:
    # The one module above client/ that composes servers (the floors test allows it).
    from torch_dataservice.config import WorkerConfig
    from torch_dataservice.dispatcher.server import DispatchServer
    from torch_dataservice.worker import launch
    from torch_dataservice.worker.server import WorkerServer

    launch.start_fork_server_here(after_torch_ops=True)  # before gRPC runs (see prepare)
    dispatcher = DispatchServer()
    num_processes = None
    if local_world_size() > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        num_processes = max(1, cores // local_world_size())
    # Executor processes may come from a fresh interpreter: let them import what the training
    # script imports from its own directory (a dataset module next to train.py), as torch's
    # spawned workers can.
    saved = os.environ.get("PYTHONPATH")
    script = sys.argv[0] if sys.argv and sys.argv[0] else ""
    paths = [os.path.dirname(os.path.abspath(script))] if os.path.isfile(script) else []
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + ([saved] if saved else []))
    try:
        worker = WorkerServer(WorkerConfig(dispatcher.address, num_processes=num_processes))
    except BaseException:
        dispatcher.stop()
        raise
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return dispatcher, worker


def shutdown() -> None:
    """Stop the embedded service (registered at exit; safe to call twice)."""
    global _servers
    with _lock:
        servers, _servers = _servers, None
    if servers is not None:
        # Readers first: their iterations are released while the service still answers.
        from torch_dataservice.torch import loader_iter

        loader_iter.close_all()
        dispatcher, worker = servers
        worker.stop()
        dispatcher.stop()

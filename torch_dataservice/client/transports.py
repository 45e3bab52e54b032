"""How a reader reaches one task's worker, chosen once per task (as tf.data service's
data-transfer clients are), best first:

  - a worker in this process: a direct call (`InProcess`);
  - a worker on this host: its data port's Unix socket; any other: its data port over TCP
    (`DataPortTransport`; worker/data_port.py, client/data_port.py);
  - a worker without a data port: gRPC streaming (`GrpcStream`).

A reader that cannot reach a data port (a firewall that lets gRPC through but not the data
port, a wrong `--data-port` mapping) falls back to gRPC streaming for that task once the port
failed `FALLBACK_AFTER_FAILURES` times in a row while the worker's gRPC port answers, with one
warning per worker and port (`DataPortFallback`). What it learnt holds for the whole process
(`FALLBACK`) for `FALLBACK_MEMORY_S`: a firewall does not open between two epochs, so later
readers (the next epoch, the next loader) read that worker over gRPC from the start instead of
waiting out the same connect timeouts again, with no second warning.

`target_workers="ANY"` skips the first two and takes the network path, as a remote trainer
would. Each transport's `fetch` raises what its path raises: grpc.RpcError, LookupError (the
worker does not know the task yet), OSError/EOFError (a connection problem, `network` paths
only), DataPortError, WorkerGone (an in-process worker stopped: choose again). `tls_refusal`
tells a TLS failure no retry mends (a certificate that does not verify, or one the worker
refuses) from the network.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from typing import Any, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from torch_dataservice import auth, fork_gate
from torch_dataservice.client.data_port import DataPortPool, OnHeader, WorkerUnavailableError
from torch_dataservice.policies import TargetWorkers
from torch_dataservice.proto import common_pb2, worker_pb2
from torch_dataservice.rpc import WORKER_SERVICE_NAME, channel_to
from torch_dataservice.wire import frame, inprocess

logger = logging.getLogger(__name__)

# TLS alerts a worker sends when it refuses this reader's certificate (or its lack of one):
# a configuration error, not the network.
REFUSING_TLS_ALERTS = frozenset({
    "TLSV13_ALERT_CERTIFICATE_REQUIRED", "SSLV3_ALERT_BAD_CERTIFICATE",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN", "TLSV1_ALERT_UNKNOWN_CA", "TLSV1_ALERT_ACCESS_DENIED"})


def tls_refusal(error: BaseException) -> str | None:
    """What is wrong when `error` is a TLS failure that no retry mends (None otherwise):
    the worker's certificate does not verify here, or the worker refused ours. Found across
    hosts: such readers said "unreachable, retrying" for ever."""
    if isinstance(error, ssl.SSLCertVerificationError):
        return (f"its TLS certificate does not verify ({error.verify_message or error}): "
                f"check that {auth.TLS_CA_ENV} is the CA that signed it and that it names the "
                "address the worker advertises (or give the worker a --worker-address its "
                "certificate names)")
    if isinstance(error, ssl.SSLError) and error.reason in REFUSING_TLS_ALERTS:
        return (f"it refused this reader's TLS client certificate ({error.reason}): set "
                f"{auth.TLS_CERT_ENV}/{auth.TLS_KEY_ENV} to a certificate signed by the CA "
                "the worker trusts (--tls-ca)")
    return None


STREAM_TIMEOUT_S = 30
FALLBACK_AFTER_FAILURES = 3  # data-port failures in a row before gRPC is tried instead
HEALTH_TIMEOUT_S = 2.0
# How long a data port found unreachable is read around before a reader tries it again (the
# firewall may have been opened, or the worker restarted at the address with another port).
FALLBACK_MEMORY_S = 600.0


class Transport(Protocol):
    network: bool  # OSError/EOFError mean the worker is unreachable (else: a real error)
    borrow: bool  # payloads are ours alone: decode may build tensors over them

    def fetch(self, request: worker_pb2.GetElementsRequest) -> tuple[Any, list]: ...


class WorkerGone(Exception):
    """The in-process worker a transport was chosen for stopped: choose again."""


class InProcess:
    """A worker in this process. Its payloads are objects of an executor thread
    (LocalElement), or shared-memory segments handed to us alone unless a cross-trainer
    cache serves the same payload to every trainer (then not borrowed)."""

    network = False

    def __init__(self, address: str, service: Any, shared: bool) -> None:
        self._address = address
        self._service = service
        self.borrow = not shared

    def fetch(self, request: worker_pb2.GetElementsRequest) -> tuple[Any, list]:
        service = inprocess.lookup(self._address)
        if service is None or service is not self._service:
            raise WorkerGone(f"worker {self._address} stopped")  # or restarted at the address
        return service.fetch(request, local=True)


class DataPortTransport:
    """Each big payload arrives in a buffer of its own: the tensors' memory. `on_header`
    (`fetch_pipelined`) lets the reader start its next fetch while the payloads stream in."""

    network = True
    borrow = True

    def __init__(self, pool: DataPortPool, target: tuple) -> None:
        self._pool = pool
        self.target = target

    def fetch(self, request: worker_pb2.GetElementsRequest) -> tuple[Any, list]:
        return self._pool.fetch(self.target, request)

    def fetch_pipelined(self, request: worker_pb2.GetElementsRequest,
                        on_header: OnHeader) -> tuple[Any, list]:
        return self._pool.fetch(self.target, request, on_header)


class GrpcStream:
    """Streamed in chunks, assembled into one buffer per big payload (wire/frame.py)."""

    network = True
    borrow = True

    def __init__(self, address: str) -> None:
        self._address = address

    def fetch(self, request: worker_pb2.GetElementsRequest) -> tuple[Any, list]:
        with fork_gate.held():  # the stream's whole read is one call
            call: Any = channel_to(self._address).unary_stream(
                f"/{WORKER_SERVICE_NAME}/StreamElements",
                request_serializer=worker_pb2.GetElementsRequest.SerializeToString,
            )(request, timeout=STREAM_TIMEOUT_S)
            try:
                return frame.assemble_frame(call)
            except BaseException:
                call.cancel()
                raise


def data_target(info: common_pb2.TaskInfo, target_workers: TargetWorkers) -> tuple | None:
    """Where to reach `info`'s worker's data port, or None (gRPC): its Unix socket if it runs
    on this host (unless target_workers is "ANY"), else its TCP port."""
    if (info.data_socket and info.host_id == inprocess.HOST_ID
            and target_workers != TargetWorkers.ANY and os.path.exists(info.data_socket)):
        return ("unix", info.data_socket)
    if info.data_port:
        host = info.worker_address.rsplit(":", 1)[0].strip("[]")
        return ("tcp", host, info.data_port)
    return None


def choose(info: common_pb2.TaskInfo, target_workers: TargetWorkers, pool: DataPortPool,
           shared: bool) -> Transport:
    """The best way to reach `info`'s worker (`shared`: a cross-trainer cache read)."""
    if info.process_id == inprocess.process_id() and target_workers != TargetWorkers.ANY:
        service = inprocess.lookup(info.worker_address)
        if service is not None:
            return InProcess(info.worker_address, service, shared)
    target = data_target(info, target_workers)
    if target is not None and not FALLBACK.unreachable(info.worker_address, target):
        return DataPortTransport(pool, target)
    return GrpcStream(info.worker_address)


def grpc_answers(address: str) -> bool:
    """The worker at `address` answers on gRPC (its health service, which needs no token)."""
    stub = health_pb2_grpc.HealthStub(channel_to(address))
    try:
        stub.Check(  # type: ignore[attr-defined]  # typeshed's HealthStub lists no methods
            health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_TIMEOUT_S)
    except grpc.RpcError:
        return False
    return True


class DataPortFallback:
    """Switch a task whose data port keeps failing to gRPC streaming, and remember the port
    as unreachable for later readers of this process (module docstring)."""

    def __init__(self, memory_s: float = FALLBACK_MEMORY_S) -> None:
        self._lock = threading.Lock()
        self._memory_s = memory_s
        self._unreachable: dict[tuple[str, tuple], float] = {}  # -> when it was found so

    def unreachable(self, worker_address: str, target: tuple) -> bool:
        """Whether `target`, the data port of `worker_address`, failed lately (read gRPC)."""
        with self._lock:
            found = self._unreachable.get((worker_address, target))
            if found is not None and time.monotonic() - found > self._memory_s:
                del self._unreachable[(worker_address, target)]  # worth another try
                found = None
        return found is not None

    def replacement(self, transport: Transport, info: common_pb2.TaskInfo,
                    failures: int, error: BaseException) -> Transport | None:
        """GrpcStream for `info`'s task if its data port failed often enough and gRPC answers
        (asked every FALLBACK_AFTER_FAILURES failures only: the check may take a while). An
        UNAVAILABLE reply (not registered yet) came through the port: no reason to leave it."""
        if (not isinstance(transport, DataPortTransport) or failures <= 0
                or failures % FALLBACK_AFTER_FAILURES
                or isinstance(error, WorkerUnavailableError)):
            return None
        if not grpc_answers(info.worker_address):
            return None  # the worker itself is down: nothing to fall back to
        key = (info.worker_address, transport.target)
        with self._lock:
            first = key not in self._unreachable
            self._unreachable.setdefault(key, time.monotonic())
        if first:
            where = ":".join(str(part) for part in transport.target[1:])
            logger.warning("cannot reach the data port %s of worker %s after %d attempts; "
                           "reading from it over gRPC instead (slower for big elements: "
                           "check that the data port is open between the hosts)", where,
                           info.worker_address, failures)
        return GrpcStream(info.worker_address)


FALLBACK = DataPortFallback()  # this process's readers share what they learnt


def task_groups(infos: list[common_pb2.TaskInfo], target_workers: TargetWorkers) -> list[list[int]]:
    """Task ids in the order fetch threads should prefer them: under "AUTO", workers in this
    process, then on this host, then the rest (a free local task is read before a remote
    one; remote ones are still read); otherwise one group. Each group is sorted by id."""
    if target_workers != TargetWorkers.AUTO:
        return [sorted(info.task_id for info in infos)]
    groups: list[list[int]] = [[], [], []]
    for info in infos:
        rank = (0 if info.process_id == inprocess.process_id()
                else 1 if info.host_id == inprocess.HOST_ID else 2)
        groups[rank].append(info.task_id)
    return [sorted(group) for group in groups if group]

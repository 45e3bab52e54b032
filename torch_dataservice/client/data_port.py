"""The reader's side of the workers' data ports (protocol: wire/data_port.py).

A `DataPortPool` keeps connections per worker target, each used by one fetch at a time. A reply's
header and small payloads come through one receive buffer; every big payload is received
straight into a buffer of its own (`recv_into`: writable, 16-byte aligned), which
`codec.decode(..., borrow=True)` turns into the tensors' memory without another copy. Buffers of
1 MiB and more come from `RecycledBuffers`: once the tensors over one are gone, it takes the
next payload, so a 10 MB batch does not cost a fresh mapping the kernel must zero page by page
(and unmap again), which made the reader's CPU per byte half as much again as the copy.

Errors: `OSError` (refused connection, reset, timeout) and `EOFError` mean the worker is
unreachable, like a retryable gRPC error; `LookupError` means the worker does not know the task
yet; `DataPortError` is a refusal (token) or a failure on the worker, which a retry would not
mend.

TLS: when this process's clients use TLS (`TORCH_DATASERVICE_TLS_CA`, auth.client_tls), TCP
connections speak TLS, verify the worker's certificate and host name against the CA, and
present `TORCH_DATASERVICE_TLS_CERT` when set (a worker with mTLS requires it). A failed
handshake is an `ssl.SSLError`, an OSError: unreachable, as for gRPC. Unix sockets stay plain.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from torch_dataservice import auth
from torch_dataservice.proto import worker_pb2
from torch_dataservice.wire.data_port import (
    ACCEPTED,
    HELLO,
    LENGTH,
    MAGIC,
    OK,
    STATUS_LENGTH,
    UNAVAILABLE,
    UNKNOWN_TASK,
    VERSION,
    block_with_kernel_timeouts,
)

# How long a connect to a data port may take before the reader counts the port unreachable
# (behind a firewall that drops packets it is the wait before the gRPC fallback).
CONNECT_TIMEOUT_ENV = "TORCH_DATASERVICE_DATA_PORT_TIMEOUT_S"
CONNECT_TIMEOUT_S = 5.0


def connect_timeout_s() -> float:
    """CONNECT_TIMEOUT_S, or the seconds (> 0) in $TORCH_DATASERVICE_DATA_PORT_TIMEOUT_S."""
    raw = os.environ.get(CONNECT_TIMEOUT_ENV)
    if raw is None:
        return CONNECT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"{CONNECT_TIMEOUT_ENV} must be a number of seconds > 0, got {raw!r}")
    return value
# The worker long-polls for 0.5 s before an empty reply: a reply this late means it hangs.
RECV_TIMEOUT_S = 30.0
# Payloads from this size on get a buffer of their own; smaller ones are copied out as bytes.
OWN_BUFFER_BYTES = 64 << 10
_RECV_BUFFER = 256 << 10

# Payloads from this size on are received into recycled buffers (RecycledBuffers).
RECYCLE_BYTES = 1 << 20
RECYCLED_BYTES = 256 << 20  # free buffers kept, at most, per process

Target = tuple  # ("unix", path) or ("tcp", host, port)
OnHeader = Callable[[worker_pb2.ElementBatchHeader], None]


class RecycledBuffers:
    """Receive buffers that come back when the last view of them is gone (tensors decoded
    over them included), for the next payload of a size they hold (thread-safe)."""

    def __init__(self, keep_bytes: int = RECYCLED_BYTES) -> None:
        self._keep_bytes = keep_bytes
        self._lock = threading.Lock()
        self._free: dict[int, list[np.ndarray]] = {}  # by capacity (whole MiB)
        self._free_bytes = 0

    def take(self, size: int) -> np.ndarray:
        """A writable uint8 array of `size` bytes, over a recycled buffer when one fits."""
        capacity = -(-size // RECYCLE_BYTES) * RECYCLE_BYTES
        with self._lock:
            free = self._free.get(capacity)
            backing = free.pop() if free else None
            if backing is not None:
                self._free_bytes -= capacity
        if backing is None:
            backing = np.empty(capacity, dtype=np.uint8)
        view = backing[:size]
        weakref.finalize(view, self._give_back, backing).atexit = False
        return view

    def _give_back(self, backing: np.ndarray) -> None:
        with self._lock:
            if self._free_bytes + backing.nbytes <= self._keep_bytes:
                self._free.setdefault(backing.nbytes, []).append(backing)
                self._free_bytes += backing.nbytes

    def clear(self) -> None:
        """Forget the free buffers (a forked child: its lock may have been held)."""
        self._lock = threading.Lock()
        self._free, self._free_bytes = {}, 0


RECYCLED = RecycledBuffers()
os.register_at_fork(after_in_child=RECYCLED.clear)


class DataPortError(RuntimeError):
    """The worker refused the connection (token) or failed to answer a request."""


class WorkerUnavailableError(ConnectionError):
    """The worker answered UNAVAILABLE (e.g. not registered yet): retry later."""


class Connection:
    """One authenticated connection to a worker's data port."""

    def __init__(self, target: Target, timeout_s: float = RECV_TIMEOUT_S) -> None:
        if target[0] == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(connect_timeout_s())
                sock.connect(target[1])
            except BaseException:
                sock.close()
                raise
        else:
            sock = _connect_tcp(target[1], target[2])
        self._sock = sock
        where = ":".join(str(part) for part in target[1:])
        try:
            token = (auth.token() or "").encode()
            sock.sendall(HELLO.pack(MAGIC, VERSION, len(token)) + token)
            answer = sock.recv(1)
            if not answer:  # e.g. the worker is stopping: retry, as for any lost connection
                raise EOFError(f"worker data port {where} closed the connection during "
                               "the handshake")
            if answer != ACCEPTED:
                raise DataPortError(
                    f"worker data port {where} refused the connection: missing or wrong "
                    f"{auth.TOKEN_ENV} token")
            # Plain: each big payload in one recv (MSG_WAITALL) of a blocking socket.
            self._waitall = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL
            if self._waitall:
                block_with_kernel_timeouts(sock, timeout_s, timeout_s)
            else:
                sock.settimeout(timeout_s)
        except BaseException:
            sock.close()
            raise
        self._timeout_s = timeout_s
        self._buffer = bytearray(_RECV_BUFFER)
        self._view = memoryview(self._buffer)
        self._start = self._end = 0  # buffered, not yet consumed bytes

    def close(self) -> None:
        self._sock.close()

    def fetch(self, request: worker_pb2.GetElementsRequest, on_header: OnHeader | None = None
              ) -> tuple[worker_pb2.ElementBatchHeader, list[Any]]:
        """The reply to `request`; `on_header(header)` runs once the header is in, before
        the payloads are read."""
        data = request.SerializeToString()
        self._sock.sendall(LENGTH.pack(len(data)) + data)
        status, length = STATUS_LENGTH.unpack(self._read(STATUS_LENGTH.size))
        if status != OK:
            message = bytes(self._read(length)).decode(errors="replace")
            if status == UNKNOWN_TASK:
                raise LookupError(message)
            if status == UNAVAILABLE:
                raise WorkerUnavailableError(message)
            raise DataPortError(message)
        header = worker_pb2.ElementBatchHeader.FromString(bytes(self._read(length)))
        if on_header is not None:
            on_header(header)
        payloads: list[Any] = []
        for info in header.elements:
            if info.size < OWN_BUFFER_BYTES:
                payloads.append(bytes(self._read(info.size)))
            else:
                buffer = (RECYCLED.take(info.size) if info.size >= RECYCLE_BYTES
                          else np.empty(info.size, dtype=np.uint8))
                self._read_into(memoryview(buffer))
                payloads.append(memoryview(buffer))
        return header, payloads

    def _read(self, size: int) -> memoryview:
        """The next `size` bytes, as a view valid until the next read."""
        if self._end - self._start < size:
            if size > len(self._buffer):
                self._buffer = bytearray(size)
                self._buffer[: self._end - self._start] = self._view[self._start:self._end]
                self._view = memoryview(self._buffer)
                self._end -= self._start
                self._start = 0
            elif len(self._buffer) - self._start < size:  # no room behind: move to the front
                self._view[: self._end - self._start] = self._view[self._start:self._end]
                self._end -= self._start
                self._start = 0
            while self._end - self._start < size:
                n = self._recv_into(self._view[self._end:], 0)
                if n == 0:
                    raise EOFError("the worker closed the data connection mid-reply")
                self._end += n
        view = self._view[self._start:self._start + size]
        self._start += size
        return view

    def _read_into(self, target: memoryview) -> None:
        filled = min(self._end - self._start, target.nbytes)
        target[:filled] = self._view[self._start:self._start + filled]
        self._start += filled
        while filled < target.nbytes:
            n = self._recv_into(target[filled:], self._waitall)
            if n == 0:
                raise EOFError("the worker closed the data connection mid-reply")
            filled += n

    def _recv_into(self, view: memoryview, flags: int) -> int:
        try:
            return self._sock.recv_into(view, 0, flags)
        except BlockingIOError as error:  # SO_RCVTIMEO ran out (block_with_kernel_timeouts)
            raise TimeoutError(f"the worker sent nothing for {self._timeout_s:g}s") from error


def _connect_tcp(host: str, port: int) -> socket.socket:
    """A TCP connection to a data port, over TLS when this process's clients use it."""
    sock = socket.create_connection((host, port), timeout=connect_timeout_s())
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tls = auth.client_tls()
        if tls is None:
            return sock
        return auth.client_ssl_context(tls).wrap_socket(sock, server_hostname=host)
    except BaseException:
        sock.close()
        raise


class DataPortPool:
    """Idle connections per target; a fetch takes one (or opens one) and gives it back."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: dict[Target, list[Connection]] = {}
        self._closed = False

    def fetch(self, target: Target, request: worker_pb2.GetElementsRequest,
              on_header: OnHeader | None = None
              ) -> tuple[worker_pb2.ElementBatchHeader, list[Any]]:
        with self._lock:
            idle = self._idle.get(target)
            connection = idle.pop() if idle else None
        if connection is None:
            connection = Connection(target)
        try:
            result = connection.fetch(request, on_header)
        except (LookupError, WorkerUnavailableError):
            self._give_back(target, connection)  # a complete reply: the connection is fine
            raise
        except BaseException:
            connection.close()  # maybe mid-reply: unusable
            raise
        self._give_back(target, connection)
        return result

    def _give_back(self, target: Target, connection: Connection) -> None:
        with self._lock:
            if not self._closed:
                self._idle.setdefault(target, []).append(connection)
                return
        connection.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()

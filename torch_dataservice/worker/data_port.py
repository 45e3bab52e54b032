"""The worker's data port: GetElements over a plain socket, without gRPC.

gRPC's Python stack caps big replies far below what a socket moves (each 16 MB reply is copied
several times and cut into HTTP/2 frames under the GIL), so, like tf.data service's
``data_transfer_protocol``, a worker also serves elements on a socket of its own: a TCP listener
on its host (``WorkerConfig.data_port``, by default a free port), and a Unix domain socket in a
private temporary directory for readers on the same host. The dispatcher tells clients both
(``TaskInfo.data_port`` and ``data_socket``); a client falls back to gRPC ``StreamElements``
for a worker without them.

The protocol both ends speak is in wire/data_port.py. The worker writes each payload straight
from its buffer, never joining them: bytes with ``sendmsg``, and a payload in an executor's
shared-memory segment (worker/shm.py) with ``sendfile`` from the segment's file, so the kernel
takes the pages by reference and this process copies nothing (the copy into the socket was a
sixth of a big reply's CPU). A page sent that way is read by the reader after ``sendfile``
returns, so the connection holds such a reply's payloads (their segments stay unused) until
the reader asks again or goes; at most `HELD_BYTES` in all, beyond which a reply is copied
into the socket instead. The client reads each big payload into a buffer of its own that
becomes the decoded tensors' memory (client/data_port.py).

Trust: with ``TORCH_DATASERVICE_TOKEN`` set, a connection must present it first (compared in
constant time), as every gRPC call must (auth.py); the port binds the worker's host, which
``auth.check_bind`` has vetted. With ``WorkerConfig.tls`` the TCP listener speaks TLS (and
requires a client certificate given a CA, as gRPC does), so the token and the elements travel
encrypted; without it the token travels in clear, as over plain gRPC. The Unix socket stays
plain: it never leaves the host, and its directory is the worker user's alone.

Bounds: what a peer that never authenticates can hold is capped. A connection must finish
its handshake (TLS, then the token) within `HANDSHAKE_DEADLINE_S` in all, or it is cut; at
most `MAX_HANDSHAKING` connections may be in their handshake at once, and at most
`max_connections` (WorkerConfig.data_port_max_connections) open in all. A connection beyond
either is closed as it is accepted, with no thread started for it, and logged once a minute
per peer with a count (peers.PeerLog).
"""

from __future__ import annotations

import hmac
import logging
import os
import shutil
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

from torch_dataservice import auth
from torch_dataservice.config import TLSConfig
from torch_dataservice.peers import PeerLog, peer_host
from torch_dataservice.proto import worker_pb2
from torch_dataservice.wire.data_port import (
    ACCEPTED,
    HELLO,
    INTERNAL,
    LENGTH,
    MAGIC,
    OK,
    REFUSED,
    STATUS_LENGTH,
    UNAVAILABLE,
    UNKNOWN_TASK,
    VERSION,
    FileRange,
    block_with_kernel_timeouts,
    recv_exactly,
    send_buffers,
)
from torch_dataservice.wire.inprocess import payload_nbytes
from torch_dataservice.worker.shm import PiecedPayload

logger = logging.getLogger(__name__)

DIR_PREFIX = "tds-worker-"  # + pid + "-" + random: a private directory for the Unix socket

MAX_REQUEST_BYTES = 1 << 20

HANDSHAKE_DEADLINE_S = 5.0  # from accept to an accepted token, TLS included
MAX_HANDSHAKING = 128  # connections in their handshake at once (legitimate ones take ms)
REAP_EVERY_S = 0.5  # how often the accept loops cut handshakes past their deadline
STOP_GRACE_S = 0.5  # replies under way when the worker stops may finish (as gRPC's grace)
SEND_TIMEOUT_S = 60.0  # a reader that stops reading mid-reply loses its connection
# Bytes of sent replies the connections may hold for sendfile (see the module docstring).
HELD_BYTES = 256 << 20


def _listen_tcp(host: str, port: int = 0) -> socket.socket:
    name = host.strip("[]") or None  # "" binds every interface, as gRPC's "[::]" does
    family, kind, proto, _, address = socket.getaddrinfo(
        name, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(64)
    except BaseException:
        listener.close()
        raise
    return listener


class DataPort:
    """The listeners and connections of one worker's data port (see the module docstring).

    `fetch(request) -> (header, payloads)` answers a GetElementsRequest (WorkerService.fetch);
    `ready()` is False until the worker registered (UNAVAILABLE meanwhile, as over gRPC).
    """

    def __init__(self, fetch: Callable[[worker_pb2.GetElementsRequest], tuple[Any, list]],
                 ready: Callable[[], bool], host: str, *, port: int = 0,
                 tls: TLSConfig | None = None, max_connections: int = 1024) -> None:
        self._fetch = fetch
        self._tls_config = tls
        self._tls = auth.server_ssl_context(tls) if tls is not None else None
        self._ready = ready
        self._host = host
        self._requested_port = port  # 0: a free one (WorkerConfig.data_port)
        self._token = (auth.token() or "").encode()
        self._lock = threading.Condition()
        self._listeners: list[socket.socket] = []
        self._connections: set[socket.socket] = set()
        self._max_connections = max_connections
        # Connections still in their handshake: (peer host, deadline).
        self._handshaking: dict[socket.socket, tuple[str, float]] = {}
        self._refused = PeerLog(logger, "refused a data-port connection")
        self._cut = PeerLog(logger, "cut a data-port connection that did not complete its "
                                    f"handshake within {HANDSHAKE_DEADLINE_S:.0f}s")
        self._threads: list[threading.Thread] = []
        self._held_bytes = 0  # of replies sent from segments, until their readers ask again
        self._dir = ""
        self._stopped = False
        self.port = 0
        self.socket_path = ""
        # (transport, elements, bytes) of each reply sent: the worker's counters (metrics).
        self.on_sent: Callable[[str, int, int], None] | None = None

    def start(self) -> None:
        auth.check_bind(self._host, self._tls_config)
        try:
            tcp = _listen_tcp(self._host, self._requested_port)
        except OSError as error:
            raise OSError(f"could not bind the data port {self._host}:{self._requested_port} "
                          f"({error.strerror or error})") from error
        self.port = tcp.getsockname()[1]
        self._listeners.append(tcp)
        _remove_stale_dirs()
        # Mode 0700: ours alone. The pid in the name lets a later worker remove it if this
        # process dies without stop() (kill -9).
        self._dir = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-")
        self.socket_path = os.path.join(self._dir, "data.sock")
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind(self.socket_path)
        unix.listen(64)
        self._listeners.append(unix)
        for listener in self._listeners:
            # Set here, not in the thread: a stop() right after start() may close the
            # listener before the thread first runs.
            listener.settimeout(REAP_EVERY_S)
            thread = threading.Thread(target=self._accept_loop, args=(listener,),
                                      name="data-port-accept", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Stop listening, let replies under way finish for `STOP_GRACE_S`, then cut the rest."""
        with self._lock:
            self._stopped = True
            connections = list(self._connections)
        for listener in self._listeners:
            _shutdown(listener, socket.SHUT_RDWR)  # wakes its accept()
            listener.close()
        for conn in connections:
            _shutdown(conn, socket.SHUT_RD)  # an idle one sees the end; a busy one still sends
        with self._lock:
            self._lock.wait_for(lambda: not self._connections, STOP_GRACE_S)
            connections = list(self._connections)
        for conn in connections:
            _shutdown(conn, socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(2)
        self._listeners.clear()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""

    def _accept_loop(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, address = listener.accept()
            except TimeoutError:
                self._reap()
                continue
            except OSError:
                return  # closed by stop()
            host = peer_host(address[0]) if isinstance(address, tuple) else "this host (Unix)"
            with self._lock:
                if self._stopped:
                    conn.close()
                    return
                full = self._full()
                if full is None:
                    self._connections.add(conn)
                    self._handshaking[conn] = (host, time.monotonic() + HANDSHAKE_DEADLINE_S)
            if full is not None:
                conn.close()  # no thread for it
                self._refused.note(host, full)
                continue
            threading.Thread(target=self._serve, args=(conn,), name="data-port-conn",
                             daemon=True).start()
            self._reap()

    def _full(self) -> str | None:
        """Why a new connection is refused now (None: it is not). Called with the lock."""
        if len(self._connections) >= self._max_connections:
            return (f"{len(self._connections)} connections open, the limit "
                    "(WorkerConfig.data_port_max_connections, --data-port-max-connections)")
        if len(self._handshaking) >= MAX_HANDSHAKING:
            return f"{len(self._handshaking)} connections in their handshake already"
        return None

    def _reap(self) -> None:
        """Cut connections whose handshake is past its deadline (their recv then ends)."""
        now = time.monotonic()
        with self._lock:
            late = [(conn, host) for conn, (host, deadline) in self._handshaking.items()
                    if deadline < now]
            for conn, _ in late:
                del self._handshaking[conn]
        for conn, host in late:
            _shutdown(conn, socket.SHUT_RDWR)
            self._cut.note(host, "idle or too slow")

    def _serve(self, conn: socket.socket) -> None:
        held: list[Any] = []  # the last reply's payloads sent by sendfile (module docstring)
        try:
            if conn.family != socket.AF_UNIX:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # A backstop: the accept loops cut handshakes past their deadline (_reap).
            conn.settimeout(HANDSHAKE_DEADLINE_S + 4 * REAP_EVERY_S)
            if self._tls is not None and conn.family != socket.AF_UNIX:
                conn = self._wrap(conn)
            accepted = self._handshake(conn)
            with self._lock:
                self._handshaking.pop(conn, None)
            if not accepted:
                return
            plain = not isinstance(conn, ssl.SSLSocket)
            if plain:  # a reply in one blocking sendmsg (idle waits stay unbounded)
                block_with_kernel_timeouts(conn, SEND_TIMEOUT_S, 0)
            while True:
                conn.settimeout(None)  # idle between requests; stop() shuts it down
                try:
                    head = _recv_head(conn)
                except OSError:
                    return
                held = self._let_go(held)  # the reader asked again, or went: it has read them
                if len(head) < LENGTH.size:
                    return  # the client closed the connection
                (size,) = LENGTH.unpack(head)
                if size > MAX_REQUEST_BYTES:
                    return
                conn.settimeout(SEND_TIMEOUT_S)
                request = worker_pb2.GetElementsRequest.FromString(recv_exactly(conn, size))
                if plain:
                    conn.settimeout(None)  # blocking: SO_SNDTIMEO bounds each send
                held = self._answer(conn, request, plain)
        except Exception as error:  # a broken or misbehaving client: drop its connection
            logger.debug("data port connection closed: %s", error)
        finally:
            self._let_go(held)
            with self._lock:
                self._connections.discard(conn)
                self._handshaking.pop(conn, None)
                self._lock.notify_all()
            conn.close()

    def _wrap(self, conn: socket.socket) -> ssl.SSLSocket:
        """TLS over `conn`; the wrapped socket replaces it in `_connections` (wrapping takes
        over the descriptor) before the handshake, so stop() can still cut it."""
        assert self._tls is not None
        wrapped = self._tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
        with self._lock:
            self._connections.discard(conn)
            self._connections.add(wrapped)
            pending = self._handshaking.pop(conn, None)
            if pending is not None:  # else: cut already, and do_handshake fails at once
                self._handshaking[wrapped] = pending
        try:
            wrapped.do_handshake()
        except BaseException as error:
            self._refused.note(pending[0] if pending else "?", f"TLS handshake: {error}")
            with self._lock:
                self._connections.discard(wrapped)
                self._handshaking.pop(wrapped, None)
            wrapped.close()
            raise
        return wrapped

    def _handshake(self, conn: socket.socket) -> bool:
        magic, version, length = HELLO.unpack(recv_exactly(conn, HELLO.size))
        if magic != MAGIC or version != VERSION:
            return False
        given = recv_exactly(conn, length)
        if self._token and not hmac.compare_digest(given, self._token):
            host = self._handshaking.get(conn, ("?", 0.0))[0]
            self._refused.note(host, "a missing or wrong token")
            conn.sendall(REFUSED)
            return False
        conn.sendall(ACCEPTED)
        return True

    def _answer(self, conn: socket.socket, request: worker_pb2.GetElementsRequest,
                plain: bool) -> list[Any]:
        """Send the reply to `request`; the payloads it sent by sendfile, to hold."""
        if not self._ready():
            _send_status(conn, UNAVAILABLE, "worker has not registered with the dispatcher yet")
            return []
        try:
            header, payloads = self._fetch(request)
        except LookupError:
            _send_status(conn, UNKNOWN_TASK, f"task {request.task_id} is not known here yet")
            return []
        except Exception as error:
            logger.exception("GetElements failed")
            _send_status(conn, INTERNAL, f"{type(error).__name__}: {error}")
            return []
        for info, payload in zip(header.elements, payloads, strict=True):
            info.size = payload_nbytes(payload)
        if self.on_sent is not None and payloads:
            self.on_sent("unix" if conn.family == socket.AF_UNIX else "tcp", len(payloads),
                         sum(info.size for info in header.elements))
        header_bytes = header.SerializeToString()
        parts: list[Any] = [STATUS_LENGTH.pack(OK, len(header_bytes)) + header_bytes]
        held: list[Any] = []
        for info, payload in zip(header.elements, payloads, strict=True):
            pieced = type(payload) is PiecedPayload
            file = getattr(payload, "segment_file", None)
            if plain and (pieced or file is not None) and self._may_hold(info.size):
                # keeps its files open and its segment unused until the reader has it
                held.append(payload)
                parts.extend(payload.ranges() if file is None else
                             [FileRange(file.fd, payload.segment_start, info.size)])
            else:
                parts.extend(payload.views() if pieced else [payload])
        try:
            send_buffers(conn, parts)
        except BaseException:
            self._let_go(held)
            raise
        return held

    def _may_hold(self, size: int) -> bool:
        with self._lock:
            if self._held_bytes + size > HELD_BYTES:
                return False
            self._held_bytes += size
            return True

    def _let_go(self, held: list[Any]) -> list[Any]:
        """Release held payloads (their segments go back to the executor); an empty list."""
        if held:
            size = sum(payload_nbytes(payload) for payload in held)
            with self._lock:
                self._held_bytes -= size
            held.clear()
        return []


def _recv_head(conn: socket.socket) -> bytes:
    """The next request's length prefix, or fewer bytes when the client closed."""
    if not isinstance(conn, ssl.SSLSocket):
        return conn.recv(LENGTH.size, socket.MSG_WAITALL)
    try:
        return recv_exactly(conn, LENGTH.size)  # TLS allows no recv flags
    except EOFError:
        return b""


def _shutdown(sock: socket.socket, how: int) -> None:
    try:
        sock.shutdown(how)
    except OSError:
        pass


def _send_status(conn: socket.socket, status: int, message: str) -> None:
    data = message.encode()
    conn.sendall(STATUS_LENGTH.pack(status, len(data)) + data)


def _remove_stale_dirs() -> None:
    """Remove socket directories of this user's workers that died without stopping."""
    root = tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if not name.startswith(DIR_PREFIX):
            continue
        pid_text = name[len(DIR_PREFIX):].split("-", 1)[0]
        path = os.path.join(root, name)
        try:
            if not pid_text.isdigit() or os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            # No such process here; but /tmp may be shared with another pid namespace: only
            # a socket nobody listens on is stale.
            if not _listening(os.path.join(path, "data.sock")):
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            continue  # alive (PermissionError: someone else's), or unreadable


def _listening(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
        return True
    except OSError:
        return False  # no socket file, or nobody accepts on it
    finally:
        probe.close()

"""Big payloads written by their executor straight to the reader's socket.

A big element used to be copied into a shared-memory segment by its executor and sent from
there by the front: with the kernel's copy into the socket and the reader's copy out of it,
three copies in three processes where raw TCP makes two (issue 28's profile: the executor's
copy alone cost a third of the throughput of 9.6 MB batches). Now the executor keeps the
encoded element in its own memory (`HeldPayloads`: the parts are views of the element's
tensors, nothing is copied) and tells the front its size and a handle (`HeldElement`). When a
reader's data-port reply reaches it, the front writes the reply's head itself, passes the
connection's file descriptor to the executor (SCM_RIGHTS over their Unix socket, with
`WriteHeld`), and waits for `HeldWritten` before it writes anything more: the executor's
`sendmsg` from the element's memory is the only copy on the sending side, and the frame stays
in order.

Everything that is not a plain data-port reply (gRPC, an in-process reader, a TLS connection,
which encrypts in the front anyway) gets the payload's bytes with `HeldPayload.materialize`:
the executor writes them into a memfd the front passed it, and the front maps that (one copy,
as into a segment before).

Failure: if the executor dies or fails mid-write, the front shuts the reader's connection down
(its own descriptor and the executor's), so the reader sees the reply end short, an EOFError,
and never a complete-looking frame with wrong bytes; the task fails with its executor as before.

Memory: the front holds a `HeldPayload` as it held a segment's array; when the last reference
goes, the executor is told to forget the handle (`ForgetHeld`). An executor keeps at most
`HELD_BYTES` held; beyond it elements take the segments again. As with same-process reads, a
pipeline must not change an element after yielding it (its memory is what is sent).
"""

from __future__ import annotations

import itertools
import mmap
import os
import socket
import ssl
import stat
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from torch_dataservice.wire.data_port import send_buffers
from torch_dataservice.worker.messages import WriteHeld, write_all

HELD_BYTES = 512 << 20  # an executor's held payloads at most (as its segment pool)
# Writes at once per executor: a reader that stops reading holds one writer (up to the timeout).
MAX_WRITERS = 32
WRITE_TIMEOUT_S = 60.0  # a reader that stops reading loses its connection (data port's too)


# ------------------------------------------------------------------ in the executor
class HeldPayloads:
    """An executor's held payloads: encoded parts kept, by handle, until the front forgets."""

    def __init__(self, limit: int = HELD_BYTES) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._held: dict[int, tuple[list[Any], int]] = {}
        self._bytes = 0
        self._ids = itertools.count()
        # Threads are reused: one started per write cost as much as the copy it saved.
        self.writers = ThreadPoolExecutor(MAX_WRITERS, thread_name_prefix="executor-direct-send")

    def hold(self, parts: list[Any], size: int) -> int | None:
        """A handle for `parts` (`size` bytes), or None when `HELD_BYTES` are held already."""
        with self._lock:
            if self._bytes + size > self._limit:
                return None
            handle = next(self._ids)
            self._held[handle] = (parts, size)
            self._bytes += size
            return handle

    def forget(self, handle: int) -> None:
        with self._lock:
            _, size = self._held.pop(handle, (None, 0))
            self._bytes -= size

    def write(self, handle: int, fd: int) -> None:
        """Write payload `handle` whole to `fd`, a reader's socket or the front's memfd, then
        close `fd`; or raise."""
        with self._lock:
            parts, _ = self._held[handle]
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            try:
                for part in parts:
                    write_all(fd, part)
            finally:
                os.close(fd)
            return
        sock = socket.socket(fileno=fd)
        try:
            sock.settimeout(WRITE_TIMEOUT_S)
            send_buffers(sock, parts)
        finally:
            sock.close()

    def clear(self) -> None:
        self.writers.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._held.clear()
            self._bytes = 0


# ------------------------------------------------------------------ in the front
class HeldWriter:
    """The front's side for one executor: asks it to write held payloads, waits for answers.

    `send_with_fd(message, fd)` sends a WriteHeld and the descriptor after it, atomically
    (False: the executor is gone); `forget(handle)` tells it a payload was dropped.
    """

    def __init__(self, send_with_fd: Callable[[Any, int], bool],
                 forget: Callable[[int], None]) -> None:
        self._send_with_fd = send_with_fd
        self._forget = forget
        self._lock = threading.Lock()
        self._waiting: dict[int, list[Any]] = {}  # request -> [Event, error]
        self._requests = itertools.count()
        self._lost = False

    def payload(self, handle: int, size: int) -> HeldPayload:
        payload = HeldPayload(self, handle, size)
        finalizer = weakref.finalize(payload, self._forget, handle)
        finalizer.atexit = False
        return payload

    def write(self, handle: int, fd: int, timeout_s: float = WRITE_TIMEOUT_S) -> None:
        """Have the executor write payload `handle` to socket `fd`; OSError if it did not."""
        done = threading.Event()
        with self._lock:
            if self._lost:
                raise OSError("the executor holding this payload is gone")
            request = next(self._requests)
            waiter = self._waiting[request] = [done, None]
        try:
            if not self._send_with_fd(WriteHeld(handle, request), fd):
                raise OSError("the executor holding this payload is gone")
            if not done.wait(timeout_s):
                raise OSError(f"the executor did not write a payload within {timeout_s:.0f}s")
        finally:
            with self._lock:
                self._waiting.pop(request, None)
        if waiter[1] is not None:
            raise OSError(f"the executor could not write a payload: {waiter[1]}")

    def done(self, request: int, error: str | None) -> None:
        """HeldWritten from the executor."""
        with self._lock:
            waiter = self._waiting.get(request)
        if waiter is not None:
            waiter[1] = error
            waiter[0].set()

    def lost(self) -> None:
        """The executor died: every write waited for fails now."""
        with self._lock:
            self._lost = True
            waiting = list(self._waiting.values())
        for waiter in waiting:
            waiter[1] = "the executor died"
            waiter[0].set()


class HeldPayload:
    """A payload in its executor's memory, as the front buffers it (see the module docstring)."""

    __slots__ = ("__weakref__", "_handle", "_writer", "nbytes")

    def __init__(self, writer: HeldWriter, handle: int, size: int) -> None:
        self._writer = writer
        self._handle = handle
        self.nbytes = size

    def __len__(self) -> int:
        return self.nbytes

    def send_to(self, conn: socket.socket) -> None:
        """Have the executor write the payload to `conn` (a data-port connection, not TLS).
        On failure `conn` is shut down, so the reader sees the reply end short."""
        try:
            self._writer.write(self._handle, conn.fileno())
        except BaseException:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # the executor's copy of it too
            except OSError:
                pass
            raise

    def materialize(self) -> np.ndarray:
        """The payload's bytes in memory of the front's own: the executor writes them into a
        memfd (one copy, as into a segment), which the front maps."""
        fd = os.memfd_create("tds-held", os.MFD_CLOEXEC)
        try:
            self._writer.write(self._handle, fd)
            if os.fstat(fd).st_size != self.nbytes:
                raise OSError(f"a held payload of {self.nbytes} bytes was written as "
                              f"{os.fstat(fd).st_size}")
            return np.frombuffer(mmap.mmap(fd, self.nbytes), dtype=np.uint8)
        finally:
            os.close(fd)


def materialized(payloads: list[Any]) -> list[Any]:
    """`payloads` with every held one replaced by its bytes (for gRPC and in-process reads)."""
    return [p.materialize() if type(p) is HeldPayload else p for p in payloads]


def send_reply(conn: socket.socket, buffers: list[Any]) -> None:
    """Send a data-port reply: plain buffers with one `sendmsg`, each held payload written by
    its executor in its place (over TLS, copied here first: this process encrypts)."""
    pending: list[Any] = []
    for buffer in buffers:
        if type(buffer) is not HeldPayload:
            pending.append(buffer)
        elif isinstance(conn, ssl.SSLSocket):
            pending.append(buffer.materialize())
        else:
            send_buffers(conn, pending)
            pending = []
            buffer.send_to(conn)
    send_buffers(conn, pending)

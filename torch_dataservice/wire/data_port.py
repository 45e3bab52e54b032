"""The data-port protocol that a worker (worker/data_port.py) and a reader
(client/data_port.py) speak: GetElements over a plain socket, without gRPC.

Protocol (integers little-endian), one request at a time per connection::

    client: b"TDSP" | uint8 version (1) | uint16 token length | token (UTF-8, may be empty)
    worker: b"\\x01" (accepted), or b"\\x00" and it closes: wrong or missing token
    then, as often as the client likes:
    client: uint32 length | GetElementsRequest
    worker: uint8 status, then
        OK (0):                    the GetElements frame (wire/frame.py):
                                   uint32 header length | ElementBatchHeader | payload 0 | ...
        UNAVAILABLE (1),
        UNKNOWN_TASK (2),
        INTERNAL (3):              uint32 length | UTF-8 message

The statuses mean what the gRPC codes of ``WorkerService`` mean (UNKNOWN_TASK is UNAVAILABLE for
a task the worker does not know yet).
"""

from __future__ import annotations

import os
import socket
import ssl
import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

MAGIC = b"TDSP"
VERSION = 1
HELLO = struct.Struct("<4sBH")  # magic, version, token length
ACCEPTED, REFUSED = b"\x01", b"\x00"
OK, UNAVAILABLE, UNKNOWN_TASK, INTERNAL = range(4)
LENGTH = struct.Struct("<I")
STATUS_LENGTH = struct.Struct("<BI")
_IOV_MAX = 512  # buffers per sendmsg (Linux allows 1024)


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    """`size` bytes from `sock`; EOFError if it closes first."""
    data = bytearray(size)
    view = memoryview(data)
    filled = 0
    while filled < size:
        n = sock.recv_into(view[filled:])
        if n == 0:
            raise EOFError(f"connection closed after {filled} of {size} bytes")
        filled += n
    return bytes(data)


def block_with_kernel_timeouts(sock: socket.socket, send_s: float, receive_s: float) -> None:
    """Make plain `sock` blocking, each send bounded by `send_s` and each receive by
    `receive_s` in the kernel (SO_SNDTIMEO, SO_RCVTIMEO; 0: unbounded) rather than by
    Python's socket timeout.

    Python's timeout makes the socket non-blocking and polls before every call, so a 9.6 MB
    payload moved in a dozen partial calls, each taking the GIL back; blocking, it moves in
    one `sendmsg` (or one `recv_into` with MSG_WAITALL). A call past its bound raises
    BlockingIOError (EAGAIN), or returns what it moved so far.
    """
    sock.settimeout(None)
    for option, seconds in ((socket.SO_SNDTIMEO, send_s), (socket.SO_RCVTIMEO, receive_s)):
        sock.setsockopt(socket.SOL_SOCKET, option,
                        struct.pack("ll", int(seconds), int(seconds % 1 * 1_000_000)))


class FileRange(NamedTuple):
    """Bytes of an open file to send with `sendfile`: the kernel reads the file's pages
    itself (and over TCP hands them to the socket by reference), so the sending process
    copies nothing. The caller keeps `fd` open, and the bytes unchanged until the peer has
    read them."""

    fd: int
    offset: int
    size: int


def send_buffers(sock: socket.socket, buffers: Sequence[Any]) -> None:
    """Send `buffers` (bytes-like, or FileRange on a plain socket) back to back without
    joining them: runs of bytes-like ones in one scatter-gather `sendmsg`, a FileRange with
    `sendfile`. Over TLS, which has no sendmsg and copies to encrypt anyway, one `sendall`
    each."""
    if isinstance(sock, ssl.SSLSocket):
        for view in _views(buffers):
            sock.sendall(view)
        return
    run: list[Any] = []
    for buffer in buffers:
        if isinstance(buffer, FileRange):
            _send_views(sock, run)
            run = []
            _send_file(sock, buffer)
        else:
            run.append(buffer)
    _send_views(sock, run)


def _send_file(sock: socket.socket, source: FileRange) -> None:
    offset, end = source.offset, source.offset + source.size
    while offset < end:
        try:
            sent = os.sendfile(sock.fileno(), source.fd, offset, end - offset)
        except BlockingIOError as error:  # SO_SNDTIMEO ran out (block_with_kernel_timeouts)
            raise TimeoutError("the peer stopped reading mid-reply") from error
        if sent == 0:
            raise EOFError(f"the file ended {end - offset} bytes short of its range")
        offset += sent


def _views(buffers: Sequence[Any]) -> list[memoryview]:
    return [view for view in (memoryview(b).cast("B") for b in buffers) if view.nbytes]


def _send_views(sock: socket.socket, buffers: list[Any]) -> None:
    views = _views(buffers)
    first = 0
    while first < len(views):
        sent = sock.sendmsg(views[first:first + _IOV_MAX])
        while sent:
            view = views[first]
            if sent >= view.nbytes:
                sent -= view.nbytes
                first += 1
            else:
                views[first] = view[sent:]
                sent = 0

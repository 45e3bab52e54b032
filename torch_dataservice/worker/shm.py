"""Shared memory for big payloads between an executor process and the worker front.

A big encoded element does not travel through the executor's socket (a kernel copy on each
side, and the replica waiting for the front to read it): the executor copies it into a
*segment*, an anonymous memfd mapping reused from a pool, and sends only its header and the
segment id. A new segment's file descriptor travels once, over the same Unix socket
(SCM_RIGHTS); the front maps it and keeps the mapping. The front hands the payload out as a
numpy array over the segment; when the last reference to it is gone (the gRPC stream copied
it out, or an in-process reader's tensors built over it were freed), the front tells the
executor to reuse the segment (`("free_segment", id)`).

memfd segments have no name: nothing is left in /dev/shm whatever happens to either process,
and the memory returns to the system when both sides dropped their mappings.
"""

from __future__ import annotations

import array
import mmap
import os
import socket
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np

from torch_dataservice.wire.data_port import FileRange

# Payloads this large go through shared memory; smaller ones are cheaper on the socket.
SHM_PAYLOAD_BYTES = 1 << 20
# Bytes of segments an executor keeps (in use or free); beyond it payloads take the socket.
SHM_POOL_BYTES = 512 << 20
_ROUND = 1 << 20  # segment sizes are multiples of this, so a segment fits similar payloads


class SegmentPool:
    """The executor's segments: acquire one for a payload, reuse it when the front frees it."""

    def __init__(self, limit: int = SHM_POOL_BYTES) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._segments: dict[int, mmap.mmap] = {}
        self._free: set[int] = set()
        self._total = 0
        self._next_id = 0

    def acquire(self, size: int) -> tuple[int, mmap.mmap, int | None] | None:
        """(segment id, its mapping, its fd if new) for `size` bytes; None if the pool is full.

        The caller sends a new segment's fd to the front, then closes it.
        """
        with self._lock:
            best = None
            for seg_id in self._free:
                capacity = len(self._segments[seg_id])
                if capacity >= size and (best is None or capacity < len(self._segments[best])):
                    best = seg_id
            if best is not None:
                self._free.discard(best)
                return best, self._segments[best], None
            capacity = -(-size // _ROUND) * _ROUND
            while self._total + capacity > self._limit and self._free:
                self._drop(min(self._free, key=lambda s: len(self._segments[s])))
            if self._total + capacity > self._limit:
                return None
            seg_id = self._next_id
            self._next_id += 1
            self._total += capacity
        fd = os.memfd_create(f"tds-segment-{seg_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, capacity)
            mapping = mmap.mmap(fd, capacity)
        except BaseException:
            os.close(fd)
            with self._lock:
                self._total -= capacity
            raise
        with self._lock:
            self._segments[seg_id] = mapping
        return seg_id, mapping, fd

    def release(self, seg_id: int) -> None:
        with self._lock:
            if seg_id in self._segments:
                self._free.add(seg_id)

    def _drop(self, seg_id: int) -> None:
        self._free.discard(seg_id)
        mapping = self._segments.pop(seg_id)
        self._total -= len(mapping)
        mapping.close()

    def close(self) -> None:
        with self._lock:
            for mapping in self._segments.values():
                try:
                    mapping.close()
                except BufferError:  # still exported by a view: freed with it
                    pass
            self._segments.clear()
            self._free.clear()
            self._total = 0


def copy_into(mapping: Any, parts: list[Any]) -> None:
    """Copy the encoded `parts` to the start of `mapping` (numpy copies without the GIL)."""
    target = np.frombuffer(mapping, dtype=np.uint8)
    offset = 0
    for part in parts:
        source = np.frombuffer(part, dtype=np.uint8)
        target[offset:offset + source.size] = source
        offset += source.size
    del target


def send_fd(sock: socket.socket, fd: int) -> None:
    send_fds(sock, [fd])


def send_fds(sock: socket.socket, fds: list[int]) -> None:
    sock.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])


def recv_fd(sock: socket.socket) -> int:
    return recv_fds(sock, 1)[0]


def recv_fds(sock: socket.socket, count: int) -> list[int]:
    """The `count` file descriptors `send_fds` sent (OSError, with none left open, if not)."""
    fds = array.array("i")
    data, ancdata, _, _ = sock.recvmsg(1, socket.CMSG_SPACE(count * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if not data or len(fds) != count:
        for fd in fds:
            os.close(fd)
        if not data:
            raise EOFError("connection closed before a payload's file descriptors")
        raise OSError(f"expected {count} file descriptors with a payload, got {len(fds)}")
    return list(fds)


class SegmentFile:
    """A shared-memory file's descriptor, closed when the last holder lets go (the map, or
    a payload the data port may still send from: its fd number must not be reused before)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._mapping: mmap.mmap | None = None
        weakref.finalize(self, os.close, fd).atexit = False

    def view(self, offset: int, count: int) -> memoryview:
        """Bytes [offset, offset + count) of the file, through a read-only mapping of it."""
        if self._mapping is None:
            self._mapping = mmap.mmap(self.fd, 0, prot=mmap.PROT_READ)
        return memoryview(self._mapping)[offset:offset + count]


FilePiece = tuple[SegmentFile, int, int]  # (file, offset, count)


class PiecedPayload:
    """A payload whose big tensors stay in shared-memory files of their own (a
    SharedElement: tensors the pipeline keeps in shared memory): the data port sends those
    bytes from the files with sendfile, so neither the executor nor the front copies them.
    Readers that need it in one buffer (gRPC, an in-process reader) get `joined()`, a copy.
    The payload keeps its files open; the executor keeps nothing for it."""

    __slots__ = ("nbytes", "pieces")

    def __init__(self, pieces: list[bytes | FilePiece], nbytes: int) -> None:
        self.pieces = pieces
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes

    def ranges(self) -> list[Any]:
        """The pieces for `wire.data_port.send_buffers`: bytes, and FileRange for files."""
        return [piece if isinstance(piece, bytes) else FileRange(piece[0].fd, *piece[1:])
                for piece in self.pieces]

    def views(self) -> list[Any]:
        """The pieces as buffers (files through read-only mappings)."""
        return [piece if isinstance(piece, bytes) else piece[0].view(*piece[1:])
                for piece in self.pieces]

    def joined(self) -> np.ndarray:
        out = np.empty(self.nbytes, dtype=np.uint8)
        copy_into(out, self.views())
        return out


def pieced_payload(pieces: tuple[bytes | tuple[int, int, int], ...], fds: list[int],
                   nbytes: int) -> PiecedPayload:
    """A SharedElement's payload: `pieces` with file numbers resolved to `fds` (taken over)."""
    files = [SegmentFile(fd) for fd in fds]
    return PiecedPayload([piece if isinstance(piece, bytes)
                          else (files[piece[0]], piece[1], piece[2]) for piece in pieces], nbytes)


class SegmentPayload(np.ndarray):
    """A payload in a segment: the data port sends it from `segment_file` with sendfile
    (the kernel reads the pages; no copy in the front). None on views made from it."""

    segment_file: SegmentFile | None = None


class SegmentMap:
    """The front's mappings of one executor's segments."""

    def __init__(self, free: Callable[[int], Any]) -> None:
        self._free = free  # tells the executor a segment may be reused
        self._mappings: dict[int, tuple[mmap.mmap, SegmentFile]] = {}

    def add(self, seg_id: int, fd: int, capacity: int) -> None:
        file = SegmentFile(fd)  # closes fd whatever happens next
        self._mappings[seg_id] = mmap.mmap(fd, capacity), file

    def close(self) -> None:
        """Drop the mappings; one still under a payload goes with the payload's last view."""
        mappings, self._mappings = self._mappings, {}
        for mapping, _ in mappings.values():
            try:
                mapping.close()
            except BufferError:
                pass

    def payload(self, seg_id: int, size: int) -> SegmentPayload:
        """The payload in segment `seg_id`: freed for reuse when the array and every view of
        it (tensors decoded over it included) are gone."""
        mapping, file = self._mappings[seg_id]
        array_ = np.frombuffer(mapping, dtype=np.uint8, count=size)
        finalizer = weakref.finalize(array_, self._free, seg_id)
        finalizer.atexit = False
        payload = array_.view(SegmentPayload)
        payload.segment_file = file
        return payload

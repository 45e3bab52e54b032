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


def copy_into(mapping: mmap.mmap, parts: list[Any]) -> None:
    """Copy the encoded `parts` to the start of `mapping` (numpy copies without the GIL)."""
    target = np.frombuffer(mapping, dtype=np.uint8)
    offset = 0
    for part in parts:
        source = np.frombuffer(part, dtype=np.uint8)
        target[offset:offset + source.size] = source
        offset += source.size
    del target


def send_fd(sock: socket.socket, fd: int) -> None:
    sock.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def recv_fd(sock: socket.socket) -> int:
    fds = array.array("i")
    data, ancdata, _, _ = sock.recvmsg(1, socket.CMSG_SPACE(fds.itemsize))
    if not data:
        raise EOFError("connection closed before a segment's file descriptor")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if len(fds) != 1:
        raise OSError(f"expected one file descriptor with a segment, got {len(fds)}")
    return fds[0]


class SegmentMap:
    """The front's mappings of one executor's segments."""

    def __init__(self, free: Callable[[int], Any]) -> None:
        self._free = free  # tells the executor a segment may be reused
        self._mappings: dict[int, mmap.mmap] = {}

    def add(self, seg_id: int, fd: int, capacity: int) -> None:
        try:
            self._mappings[seg_id] = mmap.mmap(fd, capacity)
        finally:
            os.close(fd)

    def close(self) -> None:
        """Drop the mappings; one still under a payload goes with the payload's last view."""
        mappings, self._mappings = self._mappings, {}
        for mapping in mappings.values():
            try:
                mapping.close()
            except BufferError:
                pass

    def payload(self, seg_id: int, size: int) -> np.ndarray:
        """The payload in segment `seg_id`: freed for reuse when the array and every view of
        it (tensors decoded over it included) are gone."""
        array_ = np.frombuffer(self._mappings[seg_id], dtype=np.uint8, count=size)
        finalizer = weakref.finalize(array_, self._free, seg_id)
        finalizer.atexit = False
        return array_

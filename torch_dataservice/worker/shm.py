"""Shared memory for big payloads between an executor process and the worker front.

A big encoded element does not travel through the executor's socket (a kernel copy on each
side, and the replica waiting for the front to read it): the executor copies it into a
*segment*, an anonymous memfd mapping reused from a pool, and sends only its header and the
segment id. A new segment's file descriptor travels once, over the same Unix socket
(SCM_RIGHTS); the front maps it and keeps the mapping. The front hands the payload out as a
numpy array over the segment; when the last reference to it is gone (the gRPC stream copied
it out, or an in-process reader's tensors built over it were freed), the front tells the
executor to reuse the segment (`("free_segment", id)`).

A batch can also be stacked into a segment in the first place (pipeline/collate.py, in an
executor process): the payload is then written around it in place (`SegmentPool.place`), and
the batch's 10 MB are not copied a second time.

memfd segments have no name: nothing is left in /dev/shm whatever happens to either process,
and the memory returns to the system when both sides dropped their mappings.

Segments ask for transparent huge pages (`madvise(MADV_HUGEPAGE)`, sizes in whole 2 MiB). Where
the host allows them for shared memory (`/sys/kernel/mm/transparent_hugepage/shmem_enabled`
at `advise` or more; many kernels default to `never`, and then nothing changes), the front's
sendfile and the reader's receive walk 2 MiB folios instead of 4 KiB pages (in a bare
sendfile-to-recv loop of 9.6 MB batches, about half the CPU on each end; through the worker,
mostly the front's share: docs/performance.md).
"""

from __future__ import annotations

import array
import mmap
import os
import socket
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from torch_dataservice.wire.data_port import FileRange

# Payloads this large go through shared memory; smaller ones are cheaper on the socket.
SHM_PAYLOAD_BYTES = 1 << 20
# Bytes of segments an executor keeps (in use or free); beyond it payloads take the socket.
SHM_POOL_BYTES = 512 << 20
# Segment sizes are multiples of this, so a segment fits similar payloads and is whole huge
# pages.
_ROUND = 2 << 20
# A batch stacked into a segment (`SegmentPool.array`) starts this far in, leaving room for
# the payload's header and pickle stream before it, and has this much room for what follows
# it (a batch's labels): the payload is then written around the batch, not copied.
ARRAY_OFFSET = 64 << 10
ARRAY_TAIL = 64 << 10


class SegmentPool:
    """The executor's segments: acquire one for a payload, reuse it when the front frees it.

    A segment may also hold a big batch *before* it is encoded (`array`: collate stacks into
    it, pipeline/collate.py), so the payload is made around it in place (`place`) instead of
    copied: such a segment is reused only when both the batch's memory is garbage here and
    the front freed the payload. Each segment counts its holders (`_holds`).
    """

    def __init__(self, limit: int = SHM_POOL_BYTES) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._segments: dict[int, mmap.mmap] = {}
        self._free: set[int] = set()
        self._holds: dict[int, int] = {}  # segments in use: how many holders
        self._unsent: dict[int, int] = {}  # fds the front has not been sent yet
        self._bases: dict[int, int] = {}  # each mapping's address
        self._arrays: dict[int, tuple[int, int]] = {}  # (offset, bytes) of a batch's memory
        self._placed: set[int] = set()  # segments whose batch went out in place already
        # Batches' memory found garbage (weakref callbacks may run anywhere, even inside a
        # method of this pool on the same thread): applied under the lock by the next call.
        self._dead: deque[int] = deque()
        self._total = 0
        self._next_id = 0

    def acquire(self, size: int) -> tuple[int, mmap.mmap, int | None] | None:
        """(segment id, its mapping, its fd if not sent yet) for `size` bytes; None if the
        pool is full. The caller sends that fd to the front, then closes it."""
        acquired = self._acquire(size)
        if acquired is None:
            return None
        with self._lock:
            return acquired[0], acquired[1], self._unsent.pop(acquired[0], None)

    def array(self, nbytes: int) -> np.ndarray | None:
        """Writable memory for a batch of `nbytes` that `place` can send without a copy (None:
        too small to pay, or the pool is full). Kept until the array (and every view of it,
        tensors included) is garbage and the front freed what was sent from it."""
        if nbytes < SHM_PAYLOAD_BYTES:
            return None
        acquired = self._acquire(ARRAY_OFFSET + nbytes + ARRAY_TAIL)
        if acquired is None:
            return None
        seg_id, mapping = acquired
        memory = np.frombuffer(mapping, dtype=np.uint8, count=nbytes, offset=ARRAY_OFFSET)
        with self._lock:
            self._arrays[seg_id] = (ARRAY_OFFSET, nbytes)
        finalizer = weakref.finalize(memory, self._dead.append, seg_id)
        finalizer.atexit = False
        return memory

    def place(self, parts: list[Any]) -> tuple[int, int, int, int | None] | None:
        """If one of the encoded `parts` is exactly the memory of an `array` (a batch stacked
        there), write the others around it and return (segment id, where the payload starts,
        the segment's capacity, its fd if not sent yet): the payload is in the segment with
        no copy of the batch. None if no part is, or the others do not fit around it."""
        with self._lock:
            self._reap()
            if not self._arrays:
                return None
            found = None
            for index, part in enumerate(parts):
                view = memoryview(part)
                if view.nbytes < SHM_PAYLOAD_BYTES:
                    continue
                address = np.frombuffer(view, dtype=np.uint8).ctypes.data
                for seg_id, (offset, nbytes) in self._arrays.items():
                    if (nbytes == view.nbytes and address == self._bases[seg_id] + offset
                            and seg_id not in self._placed):
                        found = index, seg_id, offset
                        break
                if found is not None:
                    break
            if found is None:
                return None
            index, seg_id, offset = found
            mapping = self._segments[seg_id]
            before = sum(memoryview(part).nbytes for part in parts[:index])
            after = sum(memoryview(part).nbytes for part in parts[index + 1:])
            end = offset + memoryview(parts[index]).nbytes
            if before > offset or end + after > len(mapping):
                return None
            self._placed.add(seg_id)  # sent once in place; sent again, it is copied
            self._holds[seg_id] += 1  # the front's payload
            fd = self._unsent.pop(seg_id, None)
        target = np.frombuffer(mapping, dtype=np.uint8)
        _write(target, offset - before, parts[:index])
        _write(target, end, parts[index + 1:])
        del target
        return seg_id, offset - before, len(mapping), fd

    def _acquire(self, size: int) -> tuple[int, mmap.mmap] | None:
        with self._lock:
            self._reap()
            best = None
            for seg_id in self._free:
                capacity = len(self._segments[seg_id])
                if capacity >= size and (best is None or capacity < len(self._segments[best])):
                    best = seg_id
            if best is not None:
                self._free.discard(best)
                self._holds[best] = 1
                return best, self._segments[best]
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
            ask_for_huge_pages(mapping)
        except BaseException:
            os.close(fd)
            with self._lock:
                self._total -= capacity
            raise
        base = np.frombuffer(mapping, dtype=np.uint8)
        address = base.ctypes.data
        del base
        with self._lock:
            self._segments[seg_id] = mapping
            self._bases[seg_id] = address
            self._unsent[seg_id] = fd
            self._holds[seg_id] = 1
        return seg_id, mapping

    def release(self, seg_id: int) -> None:
        """The front freed the payload sent from `seg_id`."""
        with self._lock:
            self._release(seg_id)
            self._reap()

    def _reap(self) -> None:
        while self._dead:
            self._release(self._dead.popleft())

    def _release(self, seg_id: int) -> None:
        holds = self._holds.get(seg_id)
        if holds is None:
            return
        if holds > 1:
            self._holds[seg_id] = holds - 1
            return
        del self._holds[seg_id]
        self._arrays.pop(seg_id, None)
        self._placed.discard(seg_id)
        if seg_id in self._segments:
            self._free.add(seg_id)

    def _drop(self, seg_id: int) -> None:
        self._free.discard(seg_id)
        mapping = self._segments.pop(seg_id)
        self._bases.pop(seg_id, None)
        fd = self._unsent.pop(seg_id, None)
        if fd is not None:
            os.close(fd)
        self._total -= len(mapping)
        mapping.close()

    def close(self) -> None:
        with self._lock:
            for mapping in self._segments.values():
                try:
                    mapping.close()
                except BufferError:  # still exported by a view: freed with it
                    pass
            for fd in self._unsent.values():
                os.close(fd)
            self._segments.clear()
            self._unsent.clear()
            self._free.clear()
            self._total = 0


def ask_for_huge_pages(mapping: mmap.mmap) -> bool:
    """Ask the kernel to back `mapping` with transparent huge pages (module docstring); False
    where it cannot (no MADV_HUGEPAGE here, or a kernel without THP)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return False
    try:
        mapping.madvise(advice)
    except OSError:  # EINVAL: no transparent huge pages in this kernel
        return False
    return True


def _write(target: np.ndarray, offset: int, parts: list[Any]) -> None:
    for part in parts:
        source = np.frombuffer(part, dtype=np.uint8)
        target[offset:offset + source.size] = source
        offset += source.size


def copy_into(mapping: Any, parts: list[Any]) -> None:
    """Copy the encoded `parts` to the start of `mapping` (numpy copies without the GIL)."""
    target = np.frombuffer(mapping, dtype=np.uint8)
    _write(target, 0, parts)
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
    segment_start = 0  # where the payload starts in the file


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

    def payload(self, seg_id: int, size: int, start: int = 0) -> SegmentPayload:
        """The payload at `start` in segment `seg_id`: freed for reuse when the array and
        every view of it (tensors decoded over it included) are gone."""
        mapping, file = self._mappings[seg_id]
        array_ = np.frombuffer(mapping, dtype=np.uint8, count=size, offset=start)
        finalizer = weakref.finalize(array_, self._free, seg_id)
        finalizer.atexit = False
        payload = array_.view(SegmentPayload)
        payload.segment_file = file
        payload.segment_start = start
        return payload

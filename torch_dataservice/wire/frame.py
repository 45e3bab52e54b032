"""GetElements reply framing: one protobuf header, then the element payloads back to back.

Large payloads never pass through protobuf (which would copy them into and out of a message):
the reply is ``[uint32 LE header length][ElementBatchHeader][payload 0][payload 1]...`` where the
header's ``elements[i].size`` gives the length of payload i. See protos/.../worker.proto.

StreamElements sends the same frame cut into messages of about ``STREAM_CHUNK_BYTES``
(``stream_frame``): the server copies one chunk while gRPC sends the previous one, and the client
copies each chunk it receives into the payload's own buffer (``assemble_frame``) while gRPC
receives the next, instead of each side copying a whole reply at once. A payload that arrives
within one message stays a (read-only) view of it; an assembled one is a fresh writable buffer
that ``codec.decode(..., borrow=True)`` uses without another copy.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from torch_dataservice.proto import worker_pb2
from torch_dataservice.wire.codec import Part, payload_size

__all__ = ["STREAM_CHUNK_BYTES", "assemble_frame", "build_frame", "parse_frame", "stream_frame"]

# Big enough that per-message costs vanish, small enough that copies on both sides overlap.
STREAM_CHUNK_BYTES = 1 << 20

_LENGTH = struct.Struct("<I")


def build_frame(header: worker_pb2.ElementBatchHeader, payloads: Sequence[Sequence[Part]]) -> bytes:
    """Join ``header`` and the encoded payloads into one reply with a single copy.

    ``header.elements`` must already hold one ElementInfo per payload (with its split info);
    their ``size`` fields are filled in here.
    """
    if len(header.elements) != len(payloads):
        raise ValueError(
            f"header describes {len(header.elements)} elements but {len(payloads)} payloads given"
        )
    for info, parts in zip(header.elements, payloads, strict=True):
        info.size = payload_size(parts)
    header_bytes = header.SerializeToString()
    pieces: list[Part] = [_LENGTH.pack(len(header_bytes)), header_bytes]
    for parts in payloads:
        pieces.extend(parts)
    return b"".join(pieces)


def parse_frame(
    frame: bytes | bytearray | memoryview,
) -> tuple[worker_pb2.ElementBatchHeader, list[memoryview]]:
    """Split a reply into its header and one zero-copy view of ``frame`` per element payload."""
    view = memoryview(frame).cast("B")
    header, offset = _parse_header(view)
    payloads = []
    for index, info in enumerate(header.elements):
        end = offset + info.size
        if info.size < 0 or end > view.nbytes:
            raise ValueError(
                f"element frame truncated: payload {index} of {info.size} bytes at offset "
                f"{offset} in a {view.nbytes} byte frame"
            )
        payloads.append(view[offset:end])
        offset = end
    if offset != view.nbytes:
        raise ValueError(
            f"element frame has {view.nbytes - offset} trailing bytes after "
            f"{len(header.elements)} payloads"
        )
    return header, payloads


def _parse_header(view: memoryview) -> tuple[worker_pb2.ElementBatchHeader, int]:
    if view.nbytes < _LENGTH.size:
        raise ValueError(f"element frame too short: {view.nbytes} bytes")
    (header_len,) = _LENGTH.unpack_from(view, 0)
    offset = _LENGTH.size + header_len
    if offset > view.nbytes:
        raise ValueError(
            f"element frame truncated: header of {header_len} bytes in a {view.nbytes} byte frame"
        )
    header = worker_pb2.ElementBatchHeader()
    header.ParseFromString(view[_LENGTH.size : offset])  # type: ignore[arg-type]  # any buffer
    return header, offset


def stream_frame(header: worker_pb2.ElementBatchHeader, payloads: list[Any],
                 chunk_bytes: int = STREAM_CHUNK_BYTES) -> Iterator[bytes]:
    """The frame of ``build_frame(header, [[p] for p in payloads])`` as messages of
    ``chunk_bytes`` (the last one shorter). Consumes ``payloads``: each one is dropped as soon as
    it has been copied out, so memory it holds (a shared-memory segment) is freed early."""
    if len(header.elements) != len(payloads):
        raise ValueError(
            f"header describes {len(header.elements)} elements but {len(payloads)} payloads given"
        )
    for info, payload in zip(header.elements, payloads, strict=True):
        info.size = memoryview(payload).nbytes
    header_bytes = header.SerializeToString()
    pending: list[Part] = [_LENGTH.pack(len(header_bytes)), header_bytes]
    pending_bytes = _LENGTH.size + len(header_bytes)
    queue = deque(payloads)
    payloads.clear()
    while queue:
        view = memoryview(queue.popleft()).cast("B")
        while view.nbytes:
            take = min(view.nbytes, max(1, chunk_bytes - pending_bytes))
            pending.append(view[:take])
            pending_bytes += take
            view = view[take:]
            if pending_bytes >= chunk_bytes:
                message = b"".join(pending)
                pending.clear()
                pending_bytes = 0
                yield message
        del view
    if pending:
        yield b"".join(pending)


def assemble_frame(messages: Iterator[bytes]) -> tuple[worker_pb2.ElementBatchHeader, list[Any]]:
    """The header and payloads of a frame received as ``stream_frame`` messages.

    A payload within one message is a zero-copy view of it; one spread over several is copied,
    chunk by chunk, into a buffer of its own (writable, 16-byte aligned).
    """
    first = next(messages, None)
    if first is None:
        raise ValueError("element stream ended before its header")
    view = memoryview(first).cast("B")
    header, position = _parse_header(view)
    payloads: list[Any] = []
    for index, info in enumerate(header.elements):
        size = info.size
        if size < 0:
            raise ValueError(f"element frame: payload {index} has size {size}")
        if view.nbytes - position >= size:
            payloads.append(view[position : position + size])
            position += size
            continue
        buffer = np.empty(size, dtype=np.uint8)
        filled = 0
        while True:
            take = min(size - filled, view.nbytes - position)
            # numpy copies without the GIL: gRPC keeps receiving meanwhile.
            if take:
                buffer[filled : filled + take] = np.frombuffer(view, np.uint8, take, position)
            filled += take
            position += take
            if filled == size:
                break
            message = next(messages, None)
            if message is None:
                raise ValueError(
                    f"element stream truncated: payload {index} has {filled} of {size} bytes")
            view = memoryview(message).cast("B")
            position = 0
        payloads.append(memoryview(buffer))
    if position != view.nbytes or next(messages, None) is not None:
        raise ValueError(
            f"element stream has trailing bytes after {len(header.elements)} payloads")
    return header, payloads

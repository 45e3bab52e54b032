"""GetElements reply framing: one protobuf header, then the element payloads back to back.

Large payloads never pass through protobuf (which would copy them into and out of a message):
the reply is ``[uint32 LE header length][ElementBatchHeader][payload 0][payload 1]...`` where the
header's ``elements[i].size`` gives the length of payload i. See protos/.../worker.proto.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from torch_dataservice.proto import worker_pb2
from torch_dataservice.wire.codec import Part, payload_size

__all__ = ["build_frame", "parse_frame"]

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
    if view.nbytes < _LENGTH.size:
        raise ValueError(f"element frame too short: {view.nbytes} bytes")
    (header_len,) = _LENGTH.unpack_from(view, 0)
    offset = _LENGTH.size + header_len
    if offset > view.nbytes:
        raise ValueError(
            f"element frame truncated: header of {header_len} bytes in a {view.nbytes} byte frame"
        )
    header = worker_pb2.ElementBatchHeader()
    header.ParseFromString(view[_LENGTH.size : offset])
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

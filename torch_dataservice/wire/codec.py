"""Element codec: nested tensors <-> one payload of bytes.

An element is pickled with protocol 5 so that large arrays travel out-of-band: the pickle
stream holds only structure, dtypes and shapes, and every tensor / ndarray contributes its raw
bytes as a separate buffer. ``encode`` returns the pieces without joining them, so the sender
(``wire.frame.build_frame``) joins all elements of a reply with a single copy.

Payload layout (all integers little-endian)::

    header   : magic (1 byte) | version (1 byte) | 2 bytes reserved | uint32 segment count
    segments : per segment, uint64 stored length | uint64 raw length | uint8 flags | 7 reserved
    padding  : zeros up to a multiple of 16 bytes
    data     : segment 0 = pickle stream, segments 1.. = out-of-band buffers, in order;
               each padded with zeros to a multiple of 16 bytes

Flag bit 0 marks a snappy-compressed (raw snappy format) segment. Decoding places every buffer
in one fresh, writable, 16-byte aligned buffer and rebuilds arrays and tensors as views of
it, so a decoded tensor costs one copy (or one decompression) and can be written in place.

Decoding unpickles: only decode payloads from workers you trust (see DESIGN.md, "Trust").
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
from collections.abc import Sequence
from typing import Any

import cloudpickle
import numpy as np
import snappy
import torch

try:  # python-snappy >= 0.7 is a thin layer over cramjam, which can decompress in place.
    from cramjam import snappy as _cramjam_snappy
except ImportError:  # pragma: no cover - older python-snappy builds
    _cramjam_snappy = None  # type: ignore[assignment]

__all__ = ["COMPRESSION_AUTO", "decode", "encode", "estimate_size", "payload_size"]

COMPRESSION_AUTO = "AUTO"

_MAGIC = 0xD5
_VERSION = 1
_HEADER = struct.Struct("<BBxxI")
_SEGMENT = struct.Struct("<QQB7x")
_FLAG_SNAPPY = 0x01
_ALIGN = 16
_PAD = bytes(_ALIGN)

# Below these sizes compression cannot pay for itself.
_MIN_COMPRESS_BUFFER = 64
_MIN_COMPRESS_STREAM = 1024
# Buffers this large are compressed only if _SAMPLES samples of _SAMPLE_BYTES each shrink to
# _SAMPLE_RATIO of their size (snappy keeps random bytes at ~100%, and a 10% gain does not
# pay for compressing and decompressing on a fast link).
_SAMPLE_FROM = 256 * 1024
_SAMPLES = 8
_SAMPLE_BYTES = 8 * 1024
_SAMPLE_RATIO = 0.9
# bytes objects this large go out-of-band too, so they are not copied into the pickle stream.
_MIN_OUT_OF_BAND_BYTES = 4096
# Tensors this large are looked up for `encode(shared=...)` (smaller ones are cheaper copied).
SHARED_MIN_BYTES = 64 * 1024
# Elements the standard pickler encodes exactly as ours would.
_SCALARS = frozenset({int, float, bool, str, type(None)})

Part = bytes | memoryview


def _padding(n: int) -> int:
    return -n % _ALIGN


def _rebuild_tensor(
    buffer: Any, dtype_name: str, shape: tuple[int, ...], requires_grad: bool
) -> torch.Tensor:
    """Unpickling hook: a tensor over ``buffer`` (a slice of the decode arena), not a copy."""
    dtype = getattr(torch, dtype_name)
    if not isinstance(dtype, torch.dtype):
        raise pickle.UnpicklingError(f"not a torch dtype: {dtype_name!r}")
    view = memoryview(buffer)
    if view.nbytes == 0:
        # torch.frombuffer rejects empty buffers.
        tensor = torch.empty(shape, dtype=dtype)
    else:
        if view.readonly:
            # Only reached when unpickled outside decode(); tensors must own writable memory.
            view = memoryview(bytearray(view))
        tensor = torch.frombuffer(view, dtype=dtype).reshape(shape)
    if requires_grad:
        tensor.requires_grad_(True)
    return tensor


class _ElementPickler(cloudpickle.CloudPickler):
    """Pickles CPU tensors as raw out-of-band buffers instead of torch's in-band storage format.

    CloudPickler rather than pickle.Pickler: workers run user code that was shipped by value
    (classes and namedtuples defined in a trainer's ``__main__``), and elements made of those
    classes must pickle by value too, to come back as the trainer's own classes.
    """

    # Filled only when `encode` is asked for shared sources: id(PickleBuffer) -> (fd, offset)
    # of a tensor whose storage is in shared memory.
    shared: dict[int, tuple[int, int]] | None = None

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is torch.Tensor:
            return self._reduce_tensor(obj)
        if kind is np.ndarray:
            if not (obj.flags.c_contiguous or obj.flags.f_contiguous) and not obj.dtype.hasobject:
                # numpy pickles non-contiguous arrays in-band; a contiguous copy goes out-of-band.
                return np.ascontiguousarray(obj).__reduce_ex__(5)
            return NotImplemented
        if kind is bytes:
            if len(obj) >= _MIN_OUT_OF_BAND_BYTES:
                return bytes, (pickle.PickleBuffer(obj),)
            return NotImplemented
        return super().reducer_override(obj)

    def _reduce_tensor(self, tensor: torch.Tensor) -> Any:
        if (
            tensor.device.type != "cpu"
            or tensor.layout != torch.strided
            or tensor.is_quantized
            or tensor.is_nested
        ):
            return NotImplemented  # torch's own pickling, in-band
        data = tensor.detach().resolve_conj().resolve_neg().contiguous()
        # Raw bytes through a uint8 view: works for dtypes numpy lacks (bfloat16, float8, ...).
        raw = data.reshape(-1).view(torch.uint8).numpy()
        dtype_name = str(data.dtype).removeprefix("torch.")
        buffer = pickle.PickleBuffer(raw)
        if self.shared is not None and raw.nbytes >= SHARED_MIN_BYTES:
            source = _shared_source(data)
            if source is not None:
                self.shared[id(buffer)] = source
        args = (buffer, dtype_name, tuple(data.shape), tensor.requires_grad)
        return _rebuild_tensor, args


def _shared_source(data: torch.Tensor) -> tuple[int, int] | None:
    """(fd, byte offset) of contiguous `data` in its storage's shared-memory file, if its
    storage is in shared memory by file descriptor (torch's default sharing strategy on
    Linux: `share_memory_()`, or a batch torch collated in a DataLoader worker)."""
    storage = data.untyped_storage()
    if not storage.is_shared() or data.numel() == 0:
        return None
    try:
        fd, _ = storage._share_fd_cpu_()
    except (RuntimeError, AttributeError):  # shared by file name, or another allocator
        return None
    return int(fd), int(data.storage_offset()) * data.element_size()


def _check_compression(compression: str | None) -> bool:
    if compression is None:
        return False
    if compression == COMPRESSION_AUTO:
        return True
    raise ValueError(
        f"unsupported compression {compression!r}: expected {COMPRESSION_AUTO!r} or None"
    )


def _worth_compressing(data: Part) -> bool:
    """Whether a big buffer looks compressible, judged from a few samples spread over it.

    Compressing a whole buffer of random or already compressed bytes (images, audio) costs
    about a millisecond per MiB and is then thrown away; compressing the samples costs a few
    percent of that. A buffer compressible only where no sample looks goes uncompressed:
    that costs bandwidth, never correctness.
    """
    view = memoryview(data).cast("B")
    step = len(view) // _SAMPLES
    sample = b"".join(view[i * step:i * step + _SAMPLE_BYTES] for i in range(_SAMPLES))
    return len(snappy.compress(sample)) <= _SAMPLE_RATIO * len(sample)


def _maybe_compress(data: Part, minimum: int) -> tuple[Part, bool]:
    """Snappy-compress ``data`` if that makes it smaller; otherwise keep it as is."""
    if len(data) < minimum:
        return data, False
    if len(data) >= _SAMPLE_FROM and not _worth_compressing(data):
        return data, False
    compressed = snappy.compress(data)
    if len(compressed) < len(data):
        return compressed, True
    return data, False


def encode(element: Any, compression: str | None = None,
           shared: dict[int, tuple[int, int]] | None = None) -> list[Part]:
    """Encode one element into the pieces of its payload, in order.

    The pieces reference the element's tensor memory where possible; they must be joined (or
    sent) before the element is mutated. ``compression`` is ``"AUTO"`` (snappy) or None.
    Given ``shared`` (a dict), it is filled with the pieces that are the bytes of a tensor in
    shared memory: piece index -> (the storage's fd, the bytes' offset in it), so a sender
    can pass the file rather than copy the bytes (the fd is the storage's: dup it to keep it).
    """
    compress = _check_compression(compression)
    buffers: list[pickle.PickleBuffer] = []
    sources: dict[int, tuple[int, int]] = {}
    if type(element) in _SCALARS:
        # Setting up our pickler costs more than a scalar (an index, a label, a path) itself.
        pickled: Part = pickle.dumps(element, protocol=5)
    else:
        stream = io.BytesIO()
        pickler = _ElementPickler(stream, protocol=5, buffer_callback=buffers.append)
        if shared is not None:
            pickler.shared = sources
        pickler.dump(element)
        pickled = stream.getbuffer()

    segments: list[tuple[Part, int, bool]] = []  # (stored data, raw length, compressed)
    stored, compressed = (
        _maybe_compress(pickled, _MIN_COMPRESS_STREAM) if compress else (pickled, False)
    )
    segments.append((stored, len(pickled), compressed))
    segment_sources: dict[int, tuple[int, int]] = {}
    for buffer in buffers:
        raw = buffer.raw()  # 1-D unsigned bytes view, so len() is the byte count
        stored, compressed = (
            _maybe_compress(raw, _MIN_COMPRESS_BUFFER) if compress else (raw, False)
        )
        if not compressed and id(buffer) in sources:
            segment_sources[len(segments)] = sources[id(buffer)]
        segments.append((stored, len(raw), compressed))

    table = [_HEADER.pack(_MAGIC, _VERSION, len(segments))]
    for stored, raw_len, compressed in segments:
        table.append(_SEGMENT.pack(len(stored), raw_len, _FLAG_SNAPPY if compressed else 0))
    head = b"".join(table)
    parts: list[Part] = [head + _PAD[: _padding(len(head))]]
    for index, (stored, _, _) in enumerate(segments):
        if len(stored):
            if shared is not None and index in segment_sources:
                shared[len(parts)] = segment_sources[index]
            parts.append(stored)
        if pad := _padding(len(stored)):
            parts.append(_PAD[:pad])
    return parts


def payload_size(parts: Sequence[Part]) -> int:
    """Bytes of the payload made of ``parts`` (as returned by ``encode``)."""
    return sum(memoryview(part).nbytes for part in parts)


# estimate_size: what an element of no known kind counts for, and its own overhead.
_OBJECT_BYTES = 16
_ELEMENT_BYTES = 64


def estimate_size(element: Any) -> int:
    """About the bytes ``encode(element)`` would produce, without encoding it.

    Elements kept as objects (wire/inprocess.py) are counted by this for the same memory bounds
    as encoded ones. It sums the raw bytes of tensors, arrays, bytes and strings found through
    lists, tuples, sets, dicts and instance ``__dict__``s; any other object counts what
    ``sys.getsizeof`` says (an opaque object's own buffer may escape it: the worker also caps
    how many objects are in flight).
    """
    total = _ELEMENT_BYTES
    stack = [element]
    seen: set[int] = set()
    while stack:
        obj = stack.pop()
        kind = type(obj)
        if kind in _SCALARS:
            total += len(obj) if kind is str else _OBJECT_BYTES
        elif isinstance(obj, torch.Tensor):
            total += obj.element_size() * obj.numel()
        elif isinstance(obj, np.ndarray):
            total += obj.nbytes
        elif isinstance(obj, (bytes, bytearray, memoryview)):
            total += memoryview(obj).nbytes
        elif id(obj) in seen:
            continue
        elif isinstance(obj, (list, tuple, set, frozenset)):
            seen.add(id(obj))
            total += _OBJECT_BYTES
            stack.extend(obj)
        elif isinstance(obj, dict):
            seen.add(id(obj))
            total += _OBJECT_BYTES
            stack.extend(obj.keys())
            stack.extend(obj.values())
        else:
            seen.add(id(obj))
            fields = getattr(obj, "__dict__", None)
            if isinstance(fields, dict):
                total += _OBJECT_BYTES
                stack.append(fields)
            else:
                total += max(_OBJECT_BYTES, sys.getsizeof(obj, _OBJECT_BYTES))
    return total


def _read_table(payload: memoryview) -> tuple[list[tuple[int, int, int]], int]:
    """Parse the header; return [(stored length, raw length, flags)] and the data offset."""
    if payload.nbytes < _HEADER.size:
        raise ValueError(f"element payload too short for its header: {payload.nbytes} bytes")
    magic, version, count = _HEADER.unpack_from(payload, 0)
    if magic != _MAGIC:
        raise ValueError(f"not an element payload: magic byte {magic:#04x}, expected {_MAGIC:#04x}")
    if version != _VERSION:
        raise ValueError(f"unsupported element payload version {version}, expected {_VERSION}")
    table_end = _HEADER.size + count * _SEGMENT.size
    if count < 1 or payload.nbytes < table_end:
        raise ValueError(f"corrupt element payload: {count} segments in {payload.nbytes} bytes")
    segments = [
        _SEGMENT.unpack_from(payload, _HEADER.size + i * _SEGMENT.size) for i in range(count)
    ]
    return segments, table_end + _padding(table_end)


def _decompress_into(data: memoryview, out: memoryview) -> None:
    if _cramjam_snappy is not None:
        written = _cramjam_snappy.decompress_raw_into(data, out)
    else:  # pragma: no cover - older python-snappy builds
        plain = snappy.uncompress(data)
        written = len(plain)
        if written == out.nbytes:
            out[:] = plain
    if written != out.nbytes:
        raise ValueError(f"corrupt element payload: decompressed {written}, expected {out.nbytes}")


def _decode_borrowed(payload: memoryview, segments: list[tuple[int, int, int]],
                     offset: int) -> Any:
    """`decode` over a payload given away: every buffer stored as is becomes a view of it
    (aligned by the layout), and only compressed ones are decompressed, into an arena of their
    own. A tiny compressed buffer (a batch's labels) beside a big one (its images) thus does
    not make the big one a copy."""
    arena_size = sum(raw + _padding(raw) for _, raw, flags in segments[1:]
                     if flags & _FLAG_SNAPPY)
    arena = memoryview(np.empty(arena_size, dtype=np.uint8)) if arena_size else None
    arena_offset = 0
    views: list[memoryview] = []
    for index, (stored_len, raw_len, flags) in enumerate(segments):
        view = payload[offset : offset + stored_len]
        offset += stored_len + _padding(stored_len)
        if flags & _FLAG_SNAPPY:
            if index == 0 or arena is None:
                target = memoryview(bytearray(raw_len))
            else:
                target = arena[arena_offset : arena_offset + raw_len]
                arena_offset += raw_len + _padding(raw_len)
            _decompress_into(view, target)
            view = target
        elif stored_len != raw_len:
            raise ValueError(f"corrupt element payload: segment {index} length mismatch")
        views.append(view)
    return pickle.loads(views[0], buffers=views[1:])


def decode(payload: Any, *, borrow: bool = False) -> Any:
    """Rebuild the element encoded in ``payload``.

    Tensors and arrays in the result are writable views of one fresh buffer owned by the
    result, so ``payload`` may be reused or freed afterwards. With ``borrow=True`` the caller
    gives ``payload``'s memory away (nobody else reads or writes it): if it is writable and
    16-byte aligned, tensors and arrays of buffers stored uncompressed become views of it
    instead of copies, and the result keeps it alive.
    """
    payload = memoryview(payload).cast("B")
    segments, offset = _read_table(payload)
    if offset + sum(stored + _padding(stored) for stored, _, _ in segments) > payload.nbytes:
        raise ValueError(f"corrupt element payload: truncated at {payload.nbytes} bytes")
    if len(segments) == 1 and not segments[0][2] & _FLAG_SNAPPY:
        # No buffers to place (tiny elements): unpickle in place, skip the arena.
        return pickle.loads(payload[offset : offset + segments[0][0]])
    if (borrow and not payload.readonly
            and np.frombuffer(payload, dtype=np.uint8).ctypes.data % _ALIGN == 0):
        return _decode_borrowed(payload, segments, offset)

    # One arena for all out-of-band buffers, laid out at aligned offsets.
    arena_size = sum(raw + _padding(raw) for _, raw, _ in segments[1:])
    # np.empty, not bytearray: no zero-filling of memory about to be overwritten, and large
    # blocks come back from malloc's heap instead of fresh pages (about half the cost at 16 MB).
    arena = memoryview(np.empty(arena_size, dtype=np.uint8))
    stream: Any = None
    buffers: list[memoryview] = []
    arena_offset = 0
    for index, (stored_len, raw_len, flags) in enumerate(segments):
        stored = payload[offset : offset + stored_len]
        offset += stored_len + _padding(stored_len)
        if index == 0:
            if flags & _FLAG_SNAPPY:
                stream = memoryview(bytearray(raw_len))
                _decompress_into(stored, stream)
            else:
                stream = stored
            continue
        target = arena[arena_offset : arena_offset + raw_len]
        arena_offset += raw_len + _padding(raw_len)
        if flags & _FLAG_SNAPPY:
            _decompress_into(stored, target)
        elif stored_len != raw_len:
            raise ValueError(f"corrupt element payload: segment {index} length mismatch")
        else:
            target[:] = stored
        buffers.append(target)
    return pickle.loads(stream, buffers=buffers)

"""Element codec round trips: every element kind, compression, large tensors, writability."""

from __future__ import annotations

import collections
import os
import re
from typing import Any

import numpy as np
import pytest
import torch

from torch_dataservice.wire import codec
from torch_dataservice.wire.codec import decode, encode, payload_size

Point = collections.namedtuple("Point", ["x", "y"])

COMPRESSIONS = [None, "AUTO"]


def round_trip(element: Any, compression: str | None = None) -> Any:
    parts = encode(element, compression)
    payload = b"".join(parts)
    assert payload_size(parts) == len(payload)
    return decode(memoryview(payload))


def assert_same(actual: Any, expected: Any) -> None:
    """Exact equality including container types, dtypes, shapes and requires_grad."""
    assert type(actual) is type(expected), (type(actual), type(expected))
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype
        assert actual.shape == expected.shape
        assert actual.requires_grad == expected.requires_grad
        # Compare raw bytes so that NaNs and dtypes without comparison kernels are exact too.
        a = actual.detach().contiguous().reshape(-1).view(torch.uint8)
        e = expected.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
        assert torch.equal(a, e.view(torch.uint8))
    elif isinstance(expected, np.ndarray):
        assert actual.dtype == expected.dtype
        assert actual.shape == expected.shape
        np.testing.assert_array_equal(actual, expected)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            assert_same(actual[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        if hasattr(expected, "_fields"):
            assert actual._fields == expected._fields
        for a, e in zip(actual, expected, strict=True):
            assert_same(a, e)
    elif isinstance(expected, float) and expected != expected:
        assert actual != actual
    else:
        assert actual == expected


TENSORS = {
    "float32": torch.randn(3, 4),
    "float64": torch.randn(5, dtype=torch.float64),
    "float16": torch.randn(2, 3).half(),
    "bfloat16": torch.randn(7, 3).bfloat16(),
    "int8": torch.arange(-5, 5, dtype=torch.int8),
    "uint8": torch.arange(256, dtype=torch.uint8),
    "int16": torch.arange(10, dtype=torch.int16),
    "int32": torch.arange(10, dtype=torch.int32),
    "int64": torch.arange(10, dtype=torch.int64).reshape(2, 5),
    "bool": torch.tensor([True, False, True]),
    "complex64": torch.randn(4, dtype=torch.complex64),
    "float8": torch.randn(8).to(torch.float8_e4m3fn),
    "uint16": torch.arange(10, dtype=torch.int32).to(torch.uint16),
    "zero_dim": torch.tensor(3.5),
    "zero_dim_int": torch.tensor(7),
    "empty": torch.empty(0),
    "empty_2d": torch.empty(0, 3, dtype=torch.int64),
    "empty_middle": torch.zeros(2, 0, 4),
    "transposed": torch.randn(3, 5).t(),
    "strided_slice": torch.arange(20.0)[::3],
    "expanded": torch.randn(1, 4).expand(3, 4),
    "nan_inf": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]),
    "conj": torch.randn(3, dtype=torch.complex64).conj(),
    "neg_view": torch._neg_view(torch.randn(3)),
    "requires_grad": torch.randn(2, 2, requires_grad=True),
    "non_leaf": torch.randn(2, 2, requires_grad=True) * 2,
    "big": torch.randn(1000, 257),
}


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("name", sorted(TENSORS))
def test_tensor_round_trip(name: str, compression: str | None) -> None:
    tensor = TENSORS[name]
    out = round_trip(tensor, compression)
    assert_same(out, tensor)
    assert out.is_contiguous()
    assert not out.is_conj() and not out.is_neg()
    if tensor.requires_grad:
        assert out.is_leaf


ARRAYS = {
    "float32": np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32),
    "int64": np.arange(12).reshape(3, 4),
    "bool": np.array([True, False]),
    "fortran": np.asfortranarray(np.arange(12.0).reshape(3, 4)),
    "non_contiguous": np.arange(30).reshape(5, 6)[::2, 1::2],
    "zero_dim": np.array(4.5),
    "empty": np.empty((0, 5), dtype=np.float32),
    "structured": np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")]),
    "strings": np.array(["a", "bcd"]),
    "objects": np.array([1, "x", None], dtype=object),
    "datetime": np.array(["2024-01-01"], dtype="datetime64[D]"),
    "big_endian": np.arange(5, dtype=">i4"),
}


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("name", sorted(ARRAYS))
def test_ndarray_round_trip(name: str, compression: str | None) -> None:
    array = ARRAYS[name]
    assert_same(round_trip(array, compression), array)


SCALARS = [
    0,
    -1,
    2**70,
    1.5,
    float("nan"),
    1e308,
    True,
    False,
    None,
    "",
    "héllo ✓",
    b"",
    b"\x00\xff",
    os.urandom(10_000),
    3 + 4j,
    np.float32(1.25),
    np.int64(-3),
]


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("value", SCALARS, ids=lambda v: type(v).__name__)
def test_scalar_round_trip(value: Any, compression: str | None) -> None:
    assert_same(round_trip(value, compression), value)


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_nested_round_trip(compression: str | None) -> None:
    element = {
        "image": torch.rand(3, 8, 8),
        "label": 4,
        "meta": {"name": "cat", "raw": b"\x01\x02", "none": None},
        "boxes": [torch.zeros(0, 4), np.ones((2, 4), dtype=np.float32)],
        "pair": (torch.tensor(1), "x"),
        "point": Point(x=torch.arange(3), y=np.arange(2)),
        "points": [Point(1, 2), Point(x=(3, 4), y={"z": torch.ones(1)})],
        "empty": ((), [], {}),
    }
    assert_same(round_trip(element, compression), element)


def test_shared_tensor_stays_shared() -> None:
    tensor = torch.arange(4)
    out = round_trip([tensor, tensor])
    assert out[0] is out[1]


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_decoded_tensors_and_arrays_are_writable(compression: str | None, recwarn) -> None:
    element = {"t": torch.ones(1000), "a": np.ones(1000), "b": torch.ones(2, 3).bfloat16()}
    parts = encode(element, compression)
    payload = bytes(b"".join(parts))  # read-only source: decode must still give writable memory
    out = decode(payload)
    out["t"] += 1
    out["a"] += 1
    out["b"].mul_(3)
    assert torch.equal(out["t"], torch.full((1000,), 2.0))
    assert (out["a"] == 2).all()
    assert torch.equal(out["b"], torch.full((2, 3), 3.0).bfloat16())
    assert out["a"].flags.writeable
    assert not [w for w in recwarn if "not writable" in str(w.message)]


def test_decoded_element_does_not_alias_payload() -> None:
    payload = bytearray(b"".join(encode(torch.zeros(100))))
    out = decode(payload)
    payload[:] = bytes(len(payload))
    out.fill_(1)
    assert torch.equal(out, torch.ones(100))


def test_decode_tensors_are_aligned() -> None:
    element = [torch.ones(3, dtype=torch.int8), torch.ones(5, dtype=torch.float64), np.ones(7)]
    out = round_trip(element)
    assert out[1].data_ptr() % 8 == 0
    assert out[2].ctypes.data % 8 == 0


def test_encode_references_tensor_memory_without_copy() -> None:
    tensor = torch.randn(1 << 16)
    parts = encode(tensor)
    big = [p for p in parts if len(p) == tensor.numel() * 4]
    assert len(big) == 1 and isinstance(big[0], memoryview)


def test_compression_shrinks_compressible_tensor() -> None:
    tensor = torch.arange(1 << 18, dtype=torch.float32) % 7  # 1 MiB, repetitive
    plain = payload_size(encode(tensor, None))
    compressed_parts = encode(tensor, "AUTO")
    compressed = payload_size(compressed_parts)
    assert plain > 1 << 20
    assert compressed < plain // 4
    assert_same(decode(b"".join(compressed_parts)), tensor)


def test_compression_skipped_for_incompressible_data() -> None:
    raw = os.urandom(1 << 20)
    element = {"bytes": raw, "tensor": torch.frombuffer(bytearray(raw), dtype=torch.uint8)}
    plain = payload_size(encode(element, None))
    auto_parts = encode(element, "AUTO")
    assert payload_size(auto_parts) == plain  # nothing grew, nothing was compressed
    assert_same(decode(b"".join(auto_parts)), element)


def test_incompressible_buffer_is_judged_from_samples(monkeypatch) -> None:
    """A big random buffer is not compressed whole only to be thrown away: snappy sees a
    small sample of it. A compressible one of the same size is compressed whole."""
    from torch_dataservice.wire import codec

    compressed_bytes: list[int] = []
    real = codec.snappy.compress

    def counting(data):
        compressed_bytes.append(memoryview(data).nbytes)
        return real(data)

    monkeypatch.setattr(codec.snappy, "compress", counting)
    random_tensor = torch.frombuffer(bytearray(os.urandom(4 << 20)), dtype=torch.uint8)
    parts = encode(random_tensor, "AUTO")
    assert sum(compressed_bytes) < (4 << 20) // 20, compressed_bytes
    assert_same(decode(b"".join(parts)), random_tensor)
    compressed_bytes.clear()
    zeros = torch.zeros(4 << 20, dtype=torch.uint8)
    parts = encode(zeros, "AUTO")
    assert sum(compressed_bytes) > 4 << 20  # the samples, then the whole buffer
    assert payload_size(parts) < (4 << 20) // 10
    assert_same(decode(b"".join(parts)), zeros)


def test_compressible_pickle_stream_is_compressed() -> None:
    element = ["the same string"] * 2000
    plain = payload_size(encode(element, None))
    compressed = payload_size(encode(element, "AUTO"))
    assert compressed < plain // 2
    assert round_trip(element, "AUTO") == element


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_16mb_tensor_round_trip(compression: str | None) -> None:
    tensor = torch.randn(4, 1 << 20)  # 16 MiB
    parts = encode(tensor, compression)
    assert payload_size(parts) >= tensor.numel() * 4
    assert_same(decode(b"".join(parts)), tensor)


@pytest.mark.parametrize("bad", ["snappy", "auto", "", "GZIP", 1])
def test_bad_compression_raises_naming_the_value(bad: Any) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        encode(torch.ones(1), bad)


def test_decode_rejects_garbage() -> None:
    with pytest.raises(ValueError, match="magic"):
        decode(b"\x00" * 64)
    with pytest.raises(ValueError, match="too short"):
        decode(b"\xd5")
    payload = b"".join(encode(torch.ones(100)))
    with pytest.raises(ValueError, match="truncated"):
        decode(payload[:-40])


def test_tensor_subclass_falls_back_to_torch_pickling() -> None:
    parameter = torch.nn.Parameter(torch.randn(3))
    out = round_trip(parameter)
    assert isinstance(out, torch.nn.Parameter)
    assert torch.equal(out.detach(), parameter.detach())


def test_rebuild_tolerates_read_only_buffer() -> None:
    # Outside decode() (e.g. plain pickle.loads) a buffer can be read-only bytes.
    out = codec._rebuild_tensor(b"\x00\x00\x80\x3f", "float32", (1,), False)
    out += 1
    assert out.item() == 2.0


class _Sample:
    def __init__(self, image: torch.Tensor, label: int) -> None:
        self.image, self.label = image, label


@pytest.mark.parametrize("element", [
    7,
    "a" * 5000,
    b"x" * 100_000,
    torch.zeros(1 << 20, dtype=torch.float32),
    torch.zeros(64, 64)[:, :8],  # a view: only its own bytes are encoded
    np.zeros((300, 300), dtype=np.int16),
    {"image": torch.ones(3, 64, 64), "label": 3, "path": "a/b.jpg"},
    [Point(torch.zeros(1000), np.ones(1000)) for _ in range(20)],
    _Sample(torch.zeros(50_000, dtype=torch.uint8), 1),
], ids=lambda e: type(e).__name__)
def test_estimate_size_is_close_to_the_encoded_size(element: Any) -> None:
    """Elements kept as objects (wire/inprocess.py) are counted by the estimate instead."""
    encoded = payload_size(encode(element))
    estimate = codec.estimate_size(element)
    assert encoded / 2 - 512 <= estimate <= encoded * 2 + 512, (estimate, encoded)


def test_estimate_size_survives_cycles() -> None:
    cycle: list[Any] = [torch.zeros(1000, dtype=torch.uint8)]
    cycle.append(cycle)
    assert 1000 <= codec.estimate_size(cycle) < 2000


def test_estimate_counts_an_opaque_object_by_its_own_size() -> None:
    import array

    opaque = array.array("b", bytes(1 << 20))  # no __dict__, its buffer inside the object
    assert codec.estimate_size(opaque) >= 1 << 20
    assert codec.estimate_size([opaque, opaque]) >= 1 << 20  # seen once


def test_encode_names_the_parts_that_are_tensors_in_shared_memory() -> None:
    """Only uncompressed, big-enough tensors in shared memory are named, with their file and
    the offset of their bytes in it: what an executor sends as files instead of copying."""
    import os

    big = torch.arange(100_000, dtype=torch.int64).share_memory_()
    small = torch.arange(10, dtype=torch.int64).share_memory_()
    plain = torch.arange(100_000, dtype=torch.int64)
    element = {"big": big, "rows": big.view(100, 1000)[3:13], "small": small, "plain": plain}
    shared: dict[int, tuple[int, int]] = {}
    parts = codec.encode(element, None, shared)
    assert len(shared) == 2
    for index, (fd, offset) in shared.items():
        data = bytes(memoryview(parts[index]))
        assert os.pread(fd, len(data), offset) == data
    assert sorted(offset for _, offset in shared.values()) == [0, 3 * 1000 * 8]
    assert codec.decode(b"".join(parts))["rows"].equal(big.view(100, 1000)[3:13])
    compressible = {"zeros": torch.zeros(100_000).share_memory_()}
    shared.clear()
    codec.encode(compressible, "AUTO", shared)
    assert shared == {}  # compressed: its bytes are not the file's

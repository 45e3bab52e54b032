"""GetElements reply frames: header + payloads, zero-copy parsing, malformed frames."""

from __future__ import annotations

import pytest
import torch

from torch_dataservice.proto import worker_pb2
from torch_dataservice.wire.codec import decode, encode
from torch_dataservice.wire.frame import build_frame, parse_frame


def make_header(count: int) -> worker_pb2.ElementBatchHeader:
    header = worker_pb2.ElementBatchHeader()
    for i in range(count):
        info = header.elements.add(offset=i, has_split=True)
        info.split.repetition = 1
        info.split.index = 10 + i
    return header


@pytest.mark.parametrize("compression", [None, "AUTO"])
def test_round_trip(compression: str | None) -> None:
    elements = [{"x": torch.arange(i * 100), "i": i} for i in range(5)]
    header = make_header(len(elements))
    frame = build_frame(header, [encode(e, compression) for e in elements])
    assert isinstance(frame, bytes)

    parsed, payloads = parse_frame(frame)
    assert len(payloads) == len(elements)
    assert [p.nbytes for p in payloads] == [info.size for info in parsed.elements]
    assert [info.split.index for info in parsed.elements] == [10, 11, 12, 13, 14]
    assert [info.offset for info in parsed.elements] == [0, 1, 2, 3, 4]
    assert all(info.has_split for info in parsed.elements)
    for payload, element in zip(payloads, elements, strict=True):
        out = decode(payload)
        assert out["i"] == element["i"]
        assert torch.equal(out["x"], element["x"])


def test_build_fills_sizes_in_callers_header() -> None:
    payloads = [encode(torch.ones(10)), encode("a")]
    header = make_header(2)
    build_frame(header, payloads)
    assert [info.size for info in header.elements] == [sum(len(p) for p in ps) for ps in payloads]


def test_payloads_are_zero_copy_views() -> None:
    frame = build_frame(make_header(1), [encode(torch.ones(1000))])
    _, (payload,) = parse_frame(frame)
    assert isinstance(payload, memoryview)
    assert payload.obj is frame


def test_empty_and_status_only_frames() -> None:
    header = worker_pb2.ElementBatchHeader(end_of_sequence=True)
    parsed, payloads = parse_frame(build_frame(header, []))
    assert parsed.end_of_sequence and payloads == []

    header = worker_pb2.ElementBatchHeader(has_error=True)
    header.error.type = "builtins.ZeroDivisionError"
    header.error.message = "division by zero"
    parsed, payloads = parse_frame(build_frame(header, []))
    assert parsed.has_error and parsed.error.message == "division by zero" and payloads == []


def test_large_frame() -> None:
    tensors = [torch.randn(1 << 20) for _ in range(3)]  # 12 MiB, over gRPC's default 4 MB
    frame = build_frame(make_header(3), [encode(t) for t in tensors])
    _, payloads = parse_frame(frame)
    for payload, tensor in zip(payloads, tensors, strict=True):
        assert torch.equal(decode(payload), tensor)


def test_mismatched_element_count_raises() -> None:
    with pytest.raises(ValueError, match="2 elements but 1 payloads"):
        build_frame(make_header(2), [encode(1)])


def test_malformed_frames_raise() -> None:
    frame = build_frame(make_header(2), [encode(torch.ones(10)), encode(2)])
    with pytest.raises(ValueError, match="too short"):
        parse_frame(frame[:2])
    with pytest.raises(ValueError, match="truncated"):
        parse_frame(frame[:-1])
    with pytest.raises(ValueError, match="truncated"):
        parse_frame(b"\xff\x00\x00\x00abc")
    with pytest.raises(ValueError, match="trailing"):
        parse_frame(frame + b"x")

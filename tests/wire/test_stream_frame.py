"""StreamElements frames: a frame cut into chunks, assembled back; zero-copy decode (borrow)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_dataservice.proto import worker_pb2
from torch_dataservice.wire import codec, frame


def make_header(n: int) -> worker_pb2.ElementBatchHeader:
    header = worker_pb2.ElementBatchHeader()
    for i in range(n):
        header.elements.add(offset=i)
    return header


def payloads_of(elements: list) -> list[bytes]:
    return [b"".join(codec.encode(element)) for element in elements]


ELEMENTS = [torch.arange(1000, dtype=torch.int32), 7, torch.ones(300_000, dtype=torch.uint8),
            "text", np.arange(5000, dtype=np.float64), None]


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000, 4096, 1 << 20])
def test_stream_round_trip_at_any_chunk_size(chunk: int) -> None:
    payloads = payloads_of(ELEMENTS)
    messages = list(frame.stream_frame(make_header(len(payloads)), list(payloads), chunk))
    # The first message holds the whole header (and some payload), then chunks of `chunk`.
    assert all(len(m) == chunk for m in messages[1:-1]) and 0 < len(messages[-1])
    header, received = frame.assemble_frame(iter(messages))
    assert [info.offset for info in header.elements] == list(range(len(ELEMENTS)))
    assert [bytes(p) for p in received] == payloads
    for expected, payload in zip(ELEMENTS, received, strict=True):
        actual = codec.decode(payload, borrow=True)
        if isinstance(expected, torch.Tensor):
            assert torch.equal(actual, expected)
        elif isinstance(expected, np.ndarray):
            np.testing.assert_array_equal(actual, expected)
        else:
            assert actual == expected


def test_small_frame_is_one_message_equal_to_build_frame() -> None:
    payloads = payloads_of([1, 2, "three"])
    messages = list(frame.stream_frame(make_header(3), list(payloads)))
    assert messages == [frame.build_frame(make_header(3), [[p] for p in payloads])]


def test_payload_ending_on_a_chunk_boundary() -> None:
    payload = payloads_of([torch.ones(4096, dtype=torch.uint8)])[0]
    header_bytes = len(frame.build_frame(make_header(1), [[payload]])) - len(payload)
    chunk = header_bytes + len(payload) // 2  # the payload ends exactly at message 2's end
    messages = list(frame.stream_frame(make_header(1), [payload], chunk))
    _, (received,) = frame.assemble_frame(iter(messages))
    assert bytes(received) == payload


def test_empty_batch_and_errors() -> None:
    header = make_header(0)
    header.end_of_sequence = True
    parsed, payloads = frame.assemble_frame(iter(frame.stream_frame(header, [])))
    assert parsed.end_of_sequence and payloads == []
    messages = list(frame.stream_frame(make_header(1), payloads_of([torch.ones(5000)]), 1000))
    with pytest.raises(ValueError, match="truncated"):
        frame.assemble_frame(iter(messages[:-1]))
    with pytest.raises(ValueError, match="trailing"):
        frame.assemble_frame(iter([*messages, b"x"]))
    with pytest.raises(ValueError, match="before its header"):
        frame.assemble_frame(iter([]))
    with pytest.raises(ValueError, match="payloads given"):
        list(frame.stream_frame(make_header(2), [b"x"]))


def test_assembled_payloads_are_writable_and_decode_without_a_copy() -> None:
    messages = list(frame.stream_frame(make_header(1), payloads_of([torch.zeros(100_000)]), 4096))
    _, (payload,) = frame.assemble_frame(iter(messages))
    assert not payload.readonly
    tensor = codec.decode(payload, borrow=True)
    base = np.frombuffer(payload, dtype=np.uint8).ctypes.data
    assert base <= tensor.data_ptr() < base + payload.nbytes  # a view of the payload
    tensor += 1  # writable, and the payload it lives in stays alive with it
    del payload, messages
    assert torch.equal(tensor, torch.ones(100_000))


def test_borrow_copies_when_it_cannot_share() -> None:
    element = torch.arange(10_000, dtype=torch.int64)
    readonly = b"".join(codec.encode(element))
    tensor = codec.decode(readonly, borrow=True)  # read-only payload: a copy
    assert torch.equal(tensor, element)
    tensor += 1  # writable all the same
    compressed = np.frombuffer(b"".join(codec.encode(torch.zeros(10_000), "AUTO")),
                               dtype=np.uint8).copy()
    decoded = codec.decode(compressed, borrow=True)
    assert torch.equal(decoded, torch.zeros(10_000))
    shared = np.frombuffer(b"".join(codec.encode(element)), dtype=np.uint8).copy()
    without = codec.decode(shared, borrow=False)
    assert without.data_ptr() != 0 and not (
        shared.ctypes.data <= without.data_ptr() < shared.ctypes.data + shared.nbytes)


@pytest.mark.timeout(30)
def test_borrow_shares_uncompressed_buffers_beside_compressed_ones() -> None:
    """A batch's tiny labels compress, its random images do not: the images stay a view of the
    payload (a copy of them per batch was the reader's biggest cost), the labels decompress."""
    images = torch.from_numpy(np.random.default_rng(0).random((8, 3, 32, 32), dtype=np.float32))
    labels = torch.zeros(64, dtype=torch.int64)  # compresses
    payload = np.frombuffer(b"".join(codec.encode((images, labels), "AUTO")),
                            dtype=np.uint8).copy()
    segments, _ = codec._read_table(memoryview(payload))
    assert [flags for _, _, flags in segments[1:]] == [0, codec._FLAG_SNAPPY]
    got_images, got_labels = codec.decode(payload, borrow=True)
    base = payload.ctypes.data
    assert base <= got_images.data_ptr() < base + payload.nbytes  # a view, not a copy
    assert not base <= got_labels.data_ptr() < base + payload.nbytes  # decompressed
    assert torch.equal(got_images, images) and torch.equal(got_labels, labels)
    got_labels += 1  # both writable
    got_images += 1

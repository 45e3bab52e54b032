"""How an executor turns an element with tensors in shared memory into a SharedElement."""

from __future__ import annotations

import os

import pytest
import torch

from torch_dataservice.wire import codec
from torch_dataservice.worker import executor_process, shm

pytestmark = pytest.mark.timeout(30)


def message_for(element):
    shared: dict[int, tuple[int, int]] = {}
    parts = codec.encode(element, None, shared)
    return executor_process._shared_element((1, 0), None, 0, codec.payload_size(parts),
                                            parts, shared), parts


def close(message) -> None:
    if message is not None:
        for fd in message.fds:
            os.close(fd)


def test_one_file_per_storage_and_the_payload_rebuilds_exactly() -> None:
    big = torch.arange(1_000_000, dtype=torch.int32).share_memory_()
    element = (big, big[500_000:], torch.arange(5), "label")
    message, parts = message_for(element)
    assert message is not None
    header = message.header
    assert header.files == 1 == len(message.fds)  # one storage: its fd passes once
    files = [piece for piece in header.pieces if not isinstance(piece, bytes)]
    assert [(number, at) for number, at, _ in files] == [(0, 0), (0, 2_000_000)]
    payload = shm.pieced_payload(header.pieces, message.fds, header.size)  # takes the fds
    assert bytes(payload.joined()) == b"".join(bytes(memoryview(p)) for p in parts)
    assert len(payload) == header.size == codec.payload_size(parts)
    decoded = codec.decode(payload.joined())
    assert decoded[0].equal(big) and decoded[1].equal(big[500_000:])


def test_elements_mostly_outside_shared_memory_are_copied_as_before() -> None:
    shared_part = torch.zeros(100_000, dtype=torch.uint8).share_memory_()
    plain_big = torch.ones(2 << 20, dtype=torch.uint8)  # 2 MiB to copy: past the inline bound
    message, _ = message_for((shared_part, plain_big))
    close(message)
    assert message is None
    message, _ = message_for((torch.ones(1 << 20), "x"))  # nothing shared
    assert message is None

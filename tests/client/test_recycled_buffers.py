"""The reader's recycled receive buffers: reused only once nothing views them any more."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from torch_dataservice.client.data_port import RECYCLE_BYTES, RecycledBuffers
from torch_dataservice.wire import codec

pytestmark = pytest.mark.timeout(30)


def address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_a_buffer_comes_back_only_when_its_last_tensor_is_gone() -> None:
    buffers = RecycledBuffers()
    element = (torch.arange(500_000, dtype=torch.int32), "label")
    payload = b"".join(codec.encode(element))
    first = buffers.take(len(payload))
    first[:] = np.frombuffer(payload, dtype=np.uint8)
    where = address(first)
    decoded = codec.decode(memoryview(first), borrow=True)
    assert decoded[0].data_ptr() - where < 4096  # the tensor is the buffer, not a copy
    del first
    gc.collect()
    second = buffers.take(len(payload))
    assert address(second) != where  # the tensor still uses the first one
    assert decoded[0].equal(element[0])
    kept = {where, address(second)}
    del decoded, second
    gc.collect()
    third = buffers.take(len(payload) - 5)  # the same capacity (whole MiB): one of those
    assert address(third) in kept and third.nbytes == len(payload) - 5


def test_reuse_and_the_bound_on_free_buffers() -> None:
    buffers = RecycledBuffers(keep_bytes=2 * RECYCLE_BYTES)
    taken = [buffers.take(RECYCLE_BYTES) for _ in range(3)]
    addresses = {address(t) for t in taken}
    del taken
    gc.collect()
    assert buffers._free_bytes == 2 * RECYCLE_BYTES  # the third was freed: over the bound
    again = [buffers.take(RECYCLE_BYTES) for _ in range(2)]
    assert {address(a) for a in again} <= addresses
    assert all(a.nbytes == RECYCLE_BYTES and a.flags.writeable for a in again)
    assert buffers._free_bytes == 0

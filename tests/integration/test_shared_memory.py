"""Big payloads through shared memory (worker/shm.py) and through StreamElements.

An executor copies each big element into a reusable memfd segment; the front hands it out as
an array over the segment, an in-process LOCAL reader decodes tensors over it without a copy,
and the segment is reused only once they are all gone. Nothing may outlive the worker.
"""

from __future__ import annotations

import gc
import os
import re
import sys

import cloudpickle
import pytest
import torch

import torch_dataservice as tds
from tests.conftest import wait_until
from torch_dataservice.worker import shm

pytestmark = pytest.mark.timeout(90)

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SIZE = 3 << 20  # above shm.SHM_PAYLOAD_BYTES and several stream chunks


def big(i: int) -> torch.Tensor:
    return torch.full((SIZE,), i % 251, dtype=torch.uint8)


def segment_mappings() -> list[str]:
    with open("/proc/self/maps") as maps:
        return [line for line in maps if "tds-segment" in line]


def test_segment_pool_reuses_and_bounds() -> None:
    pool = shm.SegmentPool(limit=4 << 20)
    first = pool.acquire(1 << 20)
    assert first is not None and first[2] is not None and len(first[1]) == 1 << 20
    os.close(first[2])
    second = pool.acquire(2 << 20)
    assert second is not None and second[0] != first[0]
    os.close(second[2])
    assert pool.acquire(2 << 20) is None  # 3 MB in use, 2 more would pass the limit
    pool.release(first[0])
    again = pool.acquire(100)
    assert again is not None and again[0] == first[0] and again[2] is None  # reused, no new fd
    pool.release(again[0])
    pool.release(second[0])
    third = pool.acquire(3 << 20)  # free segments are dropped to make room
    assert third is not None and third[2] is not None
    os.close(third[2])
    pool.close()


@pytest.mark.parametrize("num_processes", [1, 0])
def test_local_big_elements_are_exact_and_distinct(cluster_factory, num_processes: int) -> None:
    before_maps = set(segment_mappings())
    dev_shm = set(os.listdir("/dev/shm"))
    cluster = cluster_factory(1, num_processes=num_processes)
    n = 12
    pipeline = tds.Pipeline.range(n).map(big).apply(tds.distribute(
        "parallel_epochs", cluster.target, compression=None, target_workers="LOCAL"))
    kept = list(pipeline)  # every tensor alive at once: segments must not be reused under them
    assert sorted(int(t[0]) for t in kept) == list(range(n))
    for tensor in kept:
        assert tensor.shape == (SIZE,) and bool((tensor == tensor[0]).all())
    kept[0] += 1  # decoded tensors are writable and their own
    assert all(bool((t == t[0]).all()) for t in kept)
    del kept, pipeline, tensor
    gc.collect()
    cluster.stop()
    gc.collect()
    wait_until(lambda: set(segment_mappings()) <= before_maps, 10,
               "the worker's shared-memory segments to be unmapped")
    wait_until(lambda: not _new_in_dev_shm(dev_shm), 10,
               "nothing this test made to be left in /dev/shm")


def _new_in_dev_shm(before: set[str]) -> set[str]:
    """What appeared in /dev/shm since `before`, less what other tests running beside this one
    keep there (`make test` runs two at once): their workers' cache directories, named with
    their own process ids."""
    others = re.compile(rf"^tds-cache-(?!{os.getpid()}-)\d+-")
    return {name for name in set(os.listdir("/dev/shm")) - before if not others.match(name)}


def test_big_elements_stream_over_grpc(cluster_factory, force_grpc: None) -> None:
    cluster = cluster_factory(1, num_processes=1)
    sizes = [SIZE, 1, (1 << 20) - 7, 5 << 20, 0]

    def element(i: int) -> dict:
        return {"i": i, "data": torch.full((sizes[i],), i + 1, dtype=torch.uint8)}

    pipeline = tds.Pipeline.range(len(sizes)).map(element).apply(tds.distribute(
        "parallel_epochs", cluster.target, compression=None, target_workers="ANY"))
    received = sorted(pipeline, key=lambda e: e["i"])
    assert [e["data"].numel() for e in received] == sizes
    for e in received:
        assert bool((e["data"] == e["i"] + 1).all())

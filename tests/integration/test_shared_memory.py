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
import numpy as np
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
    unit = 2 << 20  # segments are whole huge pages
    pool = shm.SegmentPool(limit=4 * unit)
    first = pool.acquire(unit // 2)
    assert first is not None and first[2] is not None and len(first[1]) == unit
    os.close(first[2])
    second = pool.acquire(2 * unit)
    assert second is not None and second[0] != first[0]
    os.close(second[2])
    assert pool.acquire(2 * unit) is None  # 3 units in use, 2 more would pass the limit
    pool.release(first[0])
    again = pool.acquire(100)
    assert again is not None and again[0] == first[0] and again[2] is None  # reused, no new fd
    pool.release(again[0])
    pool.release(second[0])
    third = pool.acquire(3 * unit)  # free segments are dropped to make room
    assert third is not None and third[2] is not None
    os.close(third[2])
    pool.close()


def huge_page_advice(address: int) -> bool:
    """Whether the mapping at `address` of this process was advised MADV_HUGEPAGE (its
    VmFlags in /proc/self/smaps carry "hg")."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                return "hg" in line.split()
    raise AssertionError(f"no mapping at {address:#x}")


def test_segments_ask_for_huge_pages() -> None:
    """So that, where the host allows shared-memory huge pages, sendfile and the reader's
    receive walk 2 MiB folios (worker/shm.py)."""
    pool = shm.SegmentPool()
    seg_id, mapping, fd = pool.acquire(9_633_792)
    assert fd is not None
    os.close(fd)
    assert len(mapping) % (2 << 20) == 0
    address = np.frombuffer(mapping, dtype=np.uint8).ctypes.data
    assert huge_page_advice(address)
    pool.release(seg_id)
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


# ------------------------------------------------------------- batches stacked in a segment
IMAGE = (3, 40, 40)  # a batch of 256 is 1.2 MB: over shm.SHM_PAYLOAD_BYTES


def image(i: int) -> torch.Tensor:
    return torch.full(IMAGE, i % 251, dtype=torch.uint8)


def labelled(i: int) -> tuple[torch.Tensor, int]:
    return image(i), i


def _intact(images: torch.Tensor, labels: torch.Tensor) -> bool:
    expected = (labels % 251).to(torch.uint8).view(-1, 1, 1, 1).expand_as(images)
    return bool((images == expected).all())


def _segment_starts() -> dict[int, int]:
    """Start address -> end of every tds-segment mapping of this process."""
    spans = {}
    for line in segment_mappings():
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        spans[start] = end
    return spans


def test_a_batch_stacked_in_a_segment_is_sent_from_it_without_a_copy() -> None:
    pool = shm.SegmentPool(limit=16 << 20)
    memory = pool.array(2 << 20)
    assert memory is not None
    batch = torch.from_numpy(memory)
    batch[:] = 7
    parts = [b"h" * 48, b"s" * 16, memoryview(memory), b"t" * 32]
    placed = pool.place(parts)
    assert placed is not None
    seg_id, start, capacity, fd = placed
    assert fd is not None and capacity >= shm.ARRAY_OFFSET + (2 << 20)
    os.close(fd)
    assert start == shm.ARRAY_OFFSET - 64  # the header and stream just before the batch
    assert pool.place(parts) is None  # sent once in place: another send must copy
    pool.release(seg_id)  # the front is done, but the batch is alive here
    other = pool.acquire(1 << 20)
    assert other is not None and other[0] != seg_id
    assert bool((batch == 7).all())
    del batch, memory, parts
    gc.collect()
    again = pool.acquire(1 << 20)  # both holders gone: reused
    assert again is not None and again[0] == seg_id and again[2] is None
    pool.close()


def test_a_view_into_a_stacked_batch_is_copied_not_placed() -> None:
    """Writing a payload's header before a slice would overwrite the batch's other rows."""
    pool = shm.SegmentPool(limit=16 << 20)
    memory = pool.array(4 << 20)
    assert memory is not None
    memory[:] = 3
    half = memoryview(memory[2 << 20:])
    assert pool.place([b"h" * 64, half]) is None
    assert pool.place([b"h" * 64, memoryview(memory[: 2 << 20])]) is None
    assert bool((memory == 3).all())
    del half, memory
    pool.close()


def test_batches_reach_a_local_reader_from_where_they_were_stacked(cluster_factory) -> None:
    """The executor's collate stacks each batch into a segment and the front hands out the
    payload written around it: a LOCAL reader's tensors lie at the batch's place in the
    segment (a copy would put them at the payload's own start, near offset 0). Every batch
    kept alive at once stays intact (segments are not reused under them)."""
    cluster = cluster_factory(1, num_processes=1)
    batches, size = 12, 256
    pipeline = tds.Pipeline.range(batches * size).map(labelled).batch(size).apply(
        tds.distribute("parallel_epochs", cluster.target, compression=None,
                       target_workers="LOCAL"))
    kept = list(pipeline)
    assert len(kept) == batches
    spans = _segment_starts()
    for images, labels in kept:
        assert images.shape == (size, *IMAGE) and _intact(images, labels)
        address = images.data_ptr()
        start = max(s for s in spans if s <= address)
        assert address < spans[start] and address - start == shm.ARRAY_OFFSET
    assert sorted(int(label) for _, labels in kept for label in labels) == list(
        range(batches * size))
    del kept, pipeline, images, labels
    gc.collect()


@pytest.mark.parametrize("target_workers", ["ANY", "LOCAL"])
def test_many_stacked_batches_in_flight_over_the_data_port_are_intact(
        cluster_factory, request: pytest.FixtureRequest, target_workers: str) -> None:
    """Over the data port (TCP; the Unix socket, as the in-process path is off), with the
    executor far ahead of a reader that holds every batch: each arrives whole, none
    overwritten by a later one."""
    if target_workers == "LOCAL":
        request.getfixturevalue("force_grpc")  # no in-process reads: the Unix socket
    cluster = cluster_factory(1, num_processes=1)
    batches, size = 40, 256
    pipeline = tds.Pipeline.range(batches * size).map(labelled).batch(size).apply(
        tds.distribute("parallel_epochs", cluster.target, compression=None,
                       target_workers=target_workers))
    kept = list(pipeline)
    assert len(kept) == batches
    assert all(_intact(images, labels) for images, labels in kept)
    assert sorted(int(label) for _, labels in kept for label in labels) == list(
        range(batches * size))


def test_a_batch_split_after_stacking_is_intact(cluster_factory) -> None:
    """Halves of a stacked batch are views into its segment: each is copied, and neither's
    header overwrites the other's rows."""
    cluster = cluster_factory(1, num_processes=1)
    size = 512

    def halves(batch: tuple[torch.Tensor, torch.Tensor]) -> list[tuple]:
        images, labels = batch
        return [(images[: size // 2], labels[: size // 2]),
                (images[size // 2:], labels[size // 2:])]

    pipeline = tds.Pipeline.range(8 * size).map(labelled).batch(size).flat_map(halves).apply(
        tds.distribute("parallel_epochs", cluster.target, compression=None,
                       target_workers="LOCAL"))
    kept = list(pipeline)
    assert len(kept) == 16
    assert all(_intact(images, labels) for images, labels in kept)

"""Batches of decoded images, the payloads of issue 28's big-payload target: they arrive whole and
in order over the TCP data port and the Unix socket, compressed or not."""

from __future__ import annotations

import sys
import threading

import cloudpickle
import pytest
import torch

import torch_dataservice as tds

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SHAPE = (8, 3, 224, 224)  # 1.2 MB: above the 1 MiB from which payloads take shared memory
HUGE = 48 << 20  # far more than the socket buffers hold


def batch(i: int) -> tuple[torch.Tensor, int]:
    generator = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, SHAPE, dtype=torch.uint8, generator=generator), i


def huge(i: int) -> torch.Tensor:
    return torch.full((HUGE,), i + 1, dtype=torch.uint8)


@pytest.mark.parametrize("target_workers", ["ANY", "LOCAL"])
def test_big_batches_arrive_whole_and_in_order(cluster_factory, target_workers: str) -> None:
    cluster = cluster_factory(num_workers=1, num_processes=1)
    count = 12
    pipeline = tds.Pipeline.range(count).map(batch).apply(tds.distribute(
        "parallel_epochs", cluster.target, compression=None, target_workers=target_workers))
    received = []
    for images, i in pipeline:
        assert torch.equal(images, batch(i)[0]), i
        received.append(i)
    assert received == list(range(count))


def test_compressed_big_batches_arrive_whole(cluster_factory) -> None:
    cluster = cluster_factory(num_workers=1, num_processes=1)
    pipeline = tds.Pipeline.range(4).map(huge).apply(tds.distribute(
        "parallel_epochs", cluster.target, compression="AUTO", target_workers="ANY"))
    received = list(pipeline)
    assert [int(t[0]) for t in received] == [1, 2, 3, 4]
    assert all(bool((t == t[0]).all()) and t.numel() == HUGE for t in received)


def test_a_second_fetch_starts_while_big_payloads_stream_and_order_holds(
        cluster_factory, monkeypatch) -> None:
    """Pipelined fetches (client/reader.py): once a reply's header announces big payloads, the
    task's next fetch goes out while they stream in; elements still come in the worker's
    order."""
    from torch_dataservice.client import data_port

    fetch = data_port.Connection.fetch
    lock, now, most = threading.Lock(), [0], [0]

    def counted(self, request, on_header=None):
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        try:
            return fetch(self, request, on_header)
        finally:
            with lock:
                now[0] -= 1

    monkeypatch.setattr(data_port.Connection, "fetch", counted)
    cluster = cluster_factory(num_workers=1, num_processes=1)
    pipeline = tds.Pipeline.range(8).map(huge).apply(tds.distribute(
        "parallel_epochs", cluster.target, compression=None, target_workers="ANY"))
    assert [int(t[0]) for t in pipeline] == list(range(1, 9))
    assert most[0] == 2  # two at once, never more


def shared_batch(i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A batch in shared memory (as torch collates in its DataLoader workers), and a slice of
    another shared tensor (its bytes start inside its file)."""
    images = batch(i)[0].share_memory_()
    stack = torch.arange(4 * 300_000, dtype=torch.int32).add_(i).share_memory_()
    return images, stack.view(4, 300_000)[1:3], i


@pytest.mark.parametrize("path", ["ANY", "LOCAL", "grpc"])
def test_tensors_in_shared_memory_go_from_their_own_pages(cluster_factory, monkeypatch,
                                                          path: str) -> None:
    """The executor sends such tensors as their files (no copy into a segment) and the data
    port sends them with sendfile; gRPC and in-process readers get the payload joined. Every
    path delivers the same values."""
    from torch_dataservice.wire import inprocess
    from torch_dataservice.worker import shm

    made = []
    build = shm.pieced_payload

    def counted(*args):
        made.append(1)
        return build(*args)

    monkeypatch.setattr(shm, "pieced_payload", counted)
    if path == "grpc":
        monkeypatch.setattr(inprocess, "lookup", lambda address: None)
    cluster = cluster_factory(num_workers=1, num_processes=1)
    count = 10
    pipeline = tds.Pipeline.range(count).map(shared_batch).apply(tds.distribute(
        "parallel_epochs", cluster.target, compression=None,
        target_workers="ANY" if path == "grpc" else path))
    received = []
    for images, rows, i in pipeline:
        expected_images, expected_rows, _ = shared_batch(i)
        assert torch.equal(images, expected_images), i
        assert torch.equal(rows, expected_rows), i
        received.append(i)
    assert received == list(range(count))
    assert len(made) == count  # every element went as its files

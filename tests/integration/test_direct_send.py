"""Big payloads written by their executor straight to the reader's socket (worker/direct_send.py):
they arrive whole, in order, without a shared-memory copy, and an executor killed mid-write cuts
the reply short instead of letting a reader accept a wrong element."""

from __future__ import annotations

import os
import signal
import sys
import threading

import cloudpickle
import pytest
import torch

import torch_dataservice as tds
from tests.conftest import wait_until
from torch_dataservice.client import data_port as client
from torch_dataservice.errors import RemoteError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

cloudpickle.register_pickle_by_value(sys.modules[__name__])

SHAPE = (8, 3, 224, 224)  # 1.2 MB: above the 1 MiB from which payloads are held
HUGE = 48 << 20  # far more than the socket buffers hold: the executor blocks mid-write


def batch(i: int) -> tuple[torch.Tensor, int]:
    generator = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, SHAPE, dtype=torch.uint8, generator=generator), i


def huge(i: int) -> torch.Tensor:
    return torch.full((HUGE,), i + 1, dtype=torch.uint8)


def segment_mappings() -> list[str]:
    with open("/proc/self/maps") as maps:
        return [line for line in maps if "tds-segment" in line]


@pytest.mark.parametrize("target_workers", ["ANY", "LOCAL"])
def test_big_batches_arrive_whole_and_in_order_without_a_copy_to_shared_memory(
        cluster_factory, target_workers: str) -> None:
    cluster = cluster_factory(num_workers=1, num_processes=1)  # the front is this process
    count = 12
    pipeline = tds.Pipeline.range(count).map(batch).apply(tds.distribute(
        "parallel_epochs", cluster.target, compression=None, target_workers=target_workers))
    received = []
    for images, i in pipeline:
        assert torch.equal(images, batch(i)[0]), i
        received.append(i)
    assert received == list(range(count))
    assert segment_mappings() == []  # sent from the executor's memory, never copied to a segment


def test_compressed_big_batches_arrive_whole(cluster_factory) -> None:
    cluster = cluster_factory(num_workers=1, num_processes=1)
    pipeline = tds.Pipeline.range(4).map(huge).apply(tds.distribute(
        "parallel_epochs", cluster.target, compression="AUTO", target_workers="ANY"))
    assert [int(t[0]) for t in pipeline] == [1, 2, 3, 4]


def test_an_executor_killed_mid_write_cuts_the_reply_short(
        cluster_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = cluster_factory(num_workers=1, num_processes=1)
    paused, resume = threading.Event(), threading.Event()
    cut: list[BaseException] = []
    read_into = client.Connection._read_into

    def pausing(self, target: memoryview) -> None:
        if target.nbytes < HUGE or paused.is_set():
            return read_into(self, target)
        read_into(self, target[: 1 << 20])  # the reply is under way ...
        paused.set()
        resume.wait(60)  # ... and its executor is killed while it writes the rest
        try:
            read_into(self, target[1 << 20:])
        except BaseException as error:
            cut.append(error)
            raise

    monkeypatch.setattr(client.Connection, "_read_into", pausing)
    pipeline = tds.Pipeline.range(3).map(huge).apply(tds.distribute(
        "parallel_epochs", cluster.target, compression=None, target_workers="ANY"))
    executors = cluster.workers[0]._tasks._executors  # noqa: SLF001 - the front's executors
    slot = executors._slot(0)  # noqa: SLF001

    def kill() -> None:
        paused.wait(60)
        os.kill(slot.process.pid, signal.SIGKILL)
        wait_until(lambda: not slot.alive, 30, "the front to see its executor die")
        resume.set()

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    received = []
    with pytest.raises(RemoteError, match="executor process running this task died"):
        for tensor in pipeline:
            received.append(tensor)
    killer.join(30)
    assert paused.is_set()
    assert cut and isinstance(cut[0], (EOFError, OSError)), cut  # short, not accepted
    for tensor in received:  # what did arrive is whole
        assert tensor.numel() == HUGE and bool((tensor == tensor[0]).all())

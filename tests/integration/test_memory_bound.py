"""A slow consumer of large elements back-pressures the pipeline instead of growing memory.

The dispatcher and the worker run as subprocesses, so this process's RSS is the consumer's
alone: it must stay within max_outstanding_requests x element size plus a constant. The
worker's RSS (front and executor) stays bounded too: its buffers hold a few elements (credits).
"""

from __future__ import annotations

import threading
import time

import psutil
import pytest

import torch_dataservice as tds

pytestmark = pytest.mark.integration

MB = 1 << 20
ELEMENT_MB = 16
NUM_ELEMENTS = 128         # 2 GB through the consumer (the figure)
MAX_OUTSTANDING = 2
CONSTANT_MB = 128          # decoding copies, gRPC buffers, allocator slack


def big(i: int):
    import torch

    return torch.full((ELEMENT_MB * MB,), i % 251, dtype=torch.uint8)


def tree_rss(process: psutil.Process, children: bool = True) -> int:
    total = process.memory_info().rss
    if not children:
        return total
    for child in process.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total


class PeakSampler:
    def __init__(self, processes: list[tuple[psutil.Process, bool]]) -> None:
        self._processes = processes
        self.peaks = [0] * len(processes)
        self.first_half: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            for i, (process, children) in enumerate(self._processes):
                self.peaks[i] = max(self.peaks[i], tree_rss(process, children))

    def halfway(self) -> None:
        """Start the second half: the peaks so far become `first_half`."""
        self.first_half = list(self.peaks)
        self.peaks = [0] * len(self.peaks)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_slow_consumer_keeps_client_and_worker_memory_bounded(process_cluster) -> None:
    process_cluster.start_dispatcher()
    worker = process_cluster.start_worker(processes=1)
    pipeline = tds.Pipeline.range(NUM_ELEMENTS).map(big).apply(tds.distribute(
        "parallel_epochs", process_cluster.target, compression=None,
        max_outstanding_requests=MAX_OUTSTANDING))
    me = psutil.Process()
    worker_process = psutil.Process(worker.proc.pid)
    # Warm up both sides (torch imported in the executor, gRPC channels, reader threads) so the
    # baselines hold everything but the elements in flight.
    warm = tds.Pipeline.range(2).map(big).apply(tds.distribute(
        "parallel_epochs", process_cluster.target, compression=None))
    assert len(list(warm)) == 2
    client_base, worker_base = me.memory_info().rss, tree_rss(worker_process)
    count = 0
    with PeakSampler([(me, False), (worker_process, True)]) as sampler:
        for element in pipeline:
            assert int(element[0]) == count % 251
            count += 1
            del element
            if count == NUM_ELEMENTS // 2:
                sampler.halfway()
            time.sleep(0.03)  # a slow consumer
    assert count == NUM_ELEMENTS
    peaks = [max(a, b) for a, b in zip(sampler.first_half, sampler.peaks, strict=True)]
    client_growth = (peaks[0] - client_base) / MB
    worker_growth = (peaks[1] - worker_base) / MB
    print(f"client peak growth {client_growth:.0f} MB, worker peak growth "
          f"{worker_growth:.0f} MB over {NUM_ELEMENTS * ELEMENT_MB} MB read")
    # Each fetch in flight costs its reply frame, and the element being consumed its decoded
    # copy: (max_outstanding_requests + 1) elements, twice, plus a constant (allocator slack).
    assert client_growth < 2 * (MAX_OUTSTANDING + 1) * ELEMENT_MB + CONSTANT_MB
    # The worker holds what its credits allow (64 MB in flight per replica, counted in both
    # processes that map the shared memory), never the stream.
    assert worker_growth < NUM_ELEMENTS * ELEMENT_MB / 4
    # Flat: reading the second half needs no more memory than the first.
    for first, second in zip(sampler.first_half, sampler.peaks, strict=True):
        assert second < first + 2 * ELEMENT_MB * MB

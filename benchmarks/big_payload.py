"""Big payloads: batches of 64 decoded images (uint8 64x3x224x224, ~9.6 MB) from a CLI worker,
against raw TCP loopback measured in the same run.

A dispatcher and a worker (one executor process) run as CLI subprocesses. The pipeline hands
out one pre-generated batch per element (made once per executor), so what is measured is the
transport: executor -> worker front -> the data port -> this process, over TCP
(`target_workers="ANY"`, as a remote trainer reads) and over the worker's Unix socket
("LOCAL"). Each path runs three ways: with the batch in ordinary memory (the executor copies it
into a shared-memory segment, the front sends the segment with sendfile); with the batch in
shared memory (`share_memory_()`: the front sends the tensor's own pages, nobody copies before
the reader); and "stacked": each batch stacked by `.batch(64)` from 64 images in the executor,
as a real pipeline makes it (the stack's copy included: torch's collate in an executor stacks
into the segment the payload is sent from, pipeline/collate.py). The baseline is a plain
socket pair in two processes moving 9.6 MB messages (`sendall` to `recv_into`). Rounds are
interleaved (raw, TCP, TCP shared, TCP stacked, Unix, ..., raw, ...); printed are the
best MB/s of each (the least disturbed measurement on a shared machine), the median of each
round's ratio to that round's raw TCP, and CPU-seconds per GB over every process involved
(the reader, the worker with its executor, the dispatcher; for raw TCP both ends), which a busy
machine disturbs least. MB = 10**6 bytes, GB = 10**9.

    python benchmarks/big_payload.py              # about a minute
    python benchmarks/big_payload.py --rounds 5 --batches 200
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import socket
import statistics
import struct
import time

from _common import spawn_server, stop_servers
from ingest import tree_cpu

import torch_dataservice as tds

MB = 10**6
BATCH_SHAPE = (64, 3, 224, 224)
BATCH_BYTES = 64 * 3 * 224 * 224  # 9,633,792
TARGET_RATIO = 0.70  # TCP / raw TCP (issue 28)


class DecodedBatch:
    """A map fn returning one batch of images and labels, made once per executor: the
    benchmark measures moving it, not making it."""

    def __init__(self, shared: bool = False) -> None:
        self._batch = None
        self._shared = shared

    def __call__(self, index: int):
        import torch

        if self._batch is None:
            generator = torch.Generator().manual_seed(0)
            images = torch.randint(0, 256, BATCH_SHAPE, dtype=torch.uint8, generator=generator)
            if self._shared:
                images.share_memory_()
            self._batch = (images, torch.arange(64, dtype=torch.int64))
        return self._batch


class DecodedImage:
    """A map fn returning one image (a row of a batch made once per executor) and its label:
    `.batch(64)` stacks 64 of them as a real pipeline does, so the stack's copy is in."""

    def __init__(self) -> None:
        self._batch = DecodedBatch()

    def __call__(self, index: int):
        images, labels = self._batch(0)
        return images[index % len(images)], index


def read_mb_per_s(address: str, target_workers: str, batches: int, warmup: int,
                  pids: tuple[int, ...] = (), kind: str = "ordinary"
                  ) -> tuple[float, list[float]]:
    """(MB/s, CPU-seconds per GB of this process, and of each of `pids` with its
    descendants). `kind`: "ordinary" or "shared" memory for a batch made once, or "stacked"
    (each batch stacked by `.batch(64)` in the executor)."""
    if kind == "stacked":
        source = tds.Pipeline.range((batches + warmup) * BATCH_SHAPE[0]).map(
            DecodedImage()).batch(BATCH_SHAPE[0])
    else:
        source = tds.Pipeline.range(batches + warmup).map(DecodedBatch(kind == "shared"))
    pipeline = source.apply(tds.distribute(
        "parallel_epochs", f"grpc://{address}", compression=None,
        target_workers=target_workers))
    count, start = 0, 0.0
    for images, _labels in pipeline:
        if images.shape != BATCH_SHAPE:
            raise RuntimeError(f"got a batch of shape {tuple(images.shape)}")
        count += 1
        if count == warmup:
            start, cpu = time.perf_counter(), _cpu(pids)
        del images
    if count != batches + warmup:
        raise RuntimeError(f"read {count} batches, expected {batches + warmup}")
    elapsed, cpu = time.perf_counter() - start, [
        after - before for before, after in zip(cpu, _cpu(pids), strict=True)]
    gigabytes = batches * BATCH_BYTES / 1e9
    return batches * BATCH_BYTES / MB / elapsed, [c / gigabytes for c in cpu]


def _cpu(pids: tuple[int, ...]) -> list[float]:
    return [time.process_time(), *(tree_cpu(pid) for pid in pids)]


def _receive(port: int, total: int) -> None:
    """Raw TCP's receiving end: `total` bytes into one buffer, then its CPU-seconds back."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        buffer = memoryview(bytearray(BATCH_BYTES))
        sock.recv_into(buffer, 1, socket.MSG_WAITALL)  # the sender's go, not counted
        cpu = time.process_time()
        received = 0
        while received < total:
            n = sock.recv_into(buffer, min(BATCH_BYTES, total - received))
            if n == 0:
                raise ConnectionError("the sender closed early")
            received += n
        sock.sendall(struct.pack("<d", time.process_time() - cpu))


def raw_tcp(batches: int) -> tuple[float, float]:
    """Raw TCP loopback between two processes, 9.6 MB messages (`sendall` to `recv_into`):
    (MB/s, CPU-seconds per GB of both ends)."""
    total = (batches + 1) * BATCH_BYTES  # the first one warms up (pages, socket windows)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        receiver = multiprocessing.get_context("spawn").Process(
            target=_receive, args=(listener.getsockname()[1], total), daemon=True)
        receiver.start()
        conn, _ = listener.accept()
    with conn:
        data = memoryview(bytearray(os.urandom(BATCH_BYTES)))
        conn.sendall(b"g")
        conn.sendall(data)
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(batches):
            conn.sendall(data)
        (receiver_cpu,) = struct.unpack("<d", conn.recv(8, socket.MSG_WAITALL))
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    receiver.join(10)
    return batches * BATCH_BYTES / MB / elapsed, [cpu / (total / 1e9),
                                                   receiver_cpu / (total / 1e9)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=100, help="read per round and path")
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    procs = []
    with contextlib.ExitStack() as stack:
        stack.callback(stop_servers, procs)
        proc, address = spawn_server(["dispatcher", "--port", "0"])
        procs.append(proc)
        proc, _ = spawn_server(["worker", "--dispatcher", address, "--processes", "1"])
        procs.append(proc)
        pids = tuple(p.pid for p in procs)  # the dispatcher, the worker
        paths = {"TCP (ANY)": ("ANY", "ordinary"), "TCP, shared": ("ANY", "shared"),
                 "TCP, stacked": ("ANY", "stacked"), "Unix (LOCAL)": ("LOCAL", "ordinary"),
                 "Unix, shared": ("LOCAL", "shared"), "Unix, stacked": ("LOCAL", "stacked")}
        found: dict[str, list[tuple[float, list[float]]]] = {
            "raw TCP": [], **{label: [] for label in paths}}
        load = []
        for _ in range(args.rounds):
            found["raw TCP"].append(raw_tcp(args.batches))
            for label, (target_workers, kind) in paths.items():
                found[label].append(read_mb_per_s(address, target_workers, args.batches,
                                                  args.warmup, pids, kind))
            load.append(os.getloadavg()[0])
            print("  round: " + ", ".join(f"{k} {v[-1][0]:,.0f} MB/s {sum(v[-1][1]):.2f} s/GB"
                                          for k, v in found.items())
                  + f", load {load[-1]:.1f}", flush=True)
    raw = max(mbps for mbps, _ in found["raw TCP"])
    print(f"batches of {BATCH_SHAPE} uint8 ({BATCH_BYTES / MB:.1f} MB), {args.rounds} rounds, "
          f"load average {min(load):.1f}-{max(load):.1f}")
    for label, values in found.items():
        best = max(mbps for mbps, _ in values)
        median_ratio = statistics.median(
            mbps / raw_mbps
            for (mbps, _), (raw_mbps, _) in zip(values, found["raw TCP"], strict=True))
        cpu = [statistics.median(column) for column in zip(*(c for _, c in values), strict=True)]
        print(f"  {label:<14} best {best:7,.0f} MB/s = {100 * best / raw:5.1f}% of raw's best; "
              f"median of rounds {100 * median_ratio:5.1f}% of raw; {sum(cpu):.2f} CPU-s/GB ("
              + " + ".join(f"{c:.2f}" for c in cpu) + ")")
    print("  (CPU-s/GB: raw TCP's sender + receiver; the reader + the dispatcher + the worker "
          "with its executor)")
    print("  (shared: the batch in shared memory, sent from its own pages; stacked: stacked "
          "by .batch(64) in the executor)")
    for label in ("TCP (ANY)", "TCP, shared", "TCP, stacked"):
        ratio = max(mbps for mbps, _ in found[label]) / raw
        print(f"{label} / raw TCP = {ratio:.2f} (target >= {TARGET_RATIO:.2f}: "
              f"{'met' if ratio >= TARGET_RATIO else 'NOT met'})")


if __name__ == "__main__":
    main()

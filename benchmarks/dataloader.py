"""tds.DataLoader against torch.utils.data.DataLoader(num_workers=2) on the same host.

An image-like map-style dataset whose `__getitem__` costs about 2 ms of CPU (numpy work,
calibrated at start) and returns a 3x64x64 float32 tensor and a label, batched by 32 and
shuffled. Both loaders do the same work with two processes:

  torch  DataLoader(num_workers=2, persistent_workers=True)   (torch at its best: no worker
         restart between epochs)
  tds    DataLoader reading from one local WorkerServer(num_processes=2) (dispatcher and worker
         in this process, as the embedded default runs them; `--worker-process` runs them as
         `python -m torch_dataservice` subprocesses so batches travel over gRPC)

Epochs of the two alternate (torch, tds, torch, tds, ...) so a noisy shared machine hurts both
alike; the first epoch of each is a warm-up (worker start) and is not counted. The consumer
does no work: this measures the loaders. Target: tds >= 0.8x torch's batches/s.

    python benchmarks/dataloader.py --quick     # < 60 s
    python benchmarks/dataloader.py
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator

import numpy as np
import torch
from _common import HERE, HOST, child_env, local_cluster, spawn_server, stop_servers
from torch.utils.data import Dataset

import torch_dataservice as tds

TARGET_MS = 2.0
BATCH = 32


class ImageLike(Dataset):
    """A decoded-and-augmented image, simulated by `rounds` elementwise numpy passes."""

    def __init__(self, size: int, rounds: int) -> None:
        self.size = size
        self.rounds = rounds

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        rng = np.random.default_rng(index)
        image = rng.random((3, 64, 64), dtype=np.float32)
        for _ in range(self.rounds):
            image = np.tanh(image * 1.01 + 0.01)
        return torch.from_numpy(image), index % 1000


def calibrate(target_ms: float) -> tuple[int, float]:
    """Rounds of work for ~target_ms of CPU per item (process CPU time, best of several: the
    machine may be shared)."""
    probe = ImageLike(64, 10)

    def cost(dataset: ImageLike) -> float:
        best = float("inf")
        for _ in range(5):
            start = time.process_time()
            for i in range(32):
                dataset[i]
            best = min(best, (time.process_time() - start) / 32)
        return best * 1000

    per_round = (cost(probe) - cost(ImageLike(64, 0))) / 10
    rounds = max(1, round((target_ms - cost(ImageLike(64, 0))) / max(per_round, 1e-3)))
    return rounds, cost(ImageLike(64, rounds))


def time_epoch(loader: torch.utils.data.DataLoader) -> tuple[int, float]:
    start = time.perf_counter()
    count = 0
    for images, _labels in loader:
        assert images.shape[1:] == (3, 64, 64)
        count += 1
    return count, time.perf_counter() - start


@contextlib.contextmanager
def local_service(processes: int, subprocesses: bool) -> Iterator[str]:
    """`grpc://...` of a dispatcher and one worker with `processes` executor processes."""
    if not subprocesses:
        with local_cluster(processes) as dispatcher:
            yield dispatcher.target
        return
    env = child_env(HERE)  # the executors unpickle this script's dataset by reference
    dispatcher, address = spawn_server(["dispatcher", "--host", HOST, "--port", "0"], env)
    children = [dispatcher]
    try:
        children.append(spawn_server(["worker", "--dispatcher", address, "--host", HOST,
                                      "--processes", str(processes)], env)[0])
        yield f"grpc://{address}"
    finally:
        stop_servers(children)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (< 60 s)")
    parser.add_argument("--samples", type=int, default=None, help="samples per epoch")
    parser.add_argument("--epochs", type=int, default=None,
                        help="measured epochs per loader (after one warm-up epoch)")
    parser.add_argument("--worker-process", action="store_true",
                        help="run the dispatcher and the worker as subprocesses (gRPC path)")
    args = parser.parse_args()
    samples = args.samples or (1024 if args.quick else 4096)
    epochs = args.epochs or (2 if args.quick else 5)

    rounds, item_ms = calibrate(TARGET_MS)
    if args.worker_process:
        # The worker subprocess must import the dataset class: pickle it by value.
        import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])
    dataset = ImageLike(samples, rounds)
    print(f"dataset: {samples} samples of 3x64x64 float32 + label, __getitem__ "
          f"~{item_ms:.2f} ms CPU ({rounds} numpy passes), batch {BATCH}, shuffle; "
          f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")

    theirs = torch.utils.data.DataLoader(
        dataset, batch_size=BATCH, shuffle=True, num_workers=2, persistent_workers=True)
    totals = {"torch": [0, 0.0], "tds": [0, 0.0]}

    def run(name: str, loader: torch.utils.data.DataLoader, epoch: int) -> None:
        count, seconds = time_epoch(loader)
        label = "warm-up" if epoch == 0 else f"epoch {epoch}"
        print(f"  {name:5s} {label:8s}: {count} batches in {seconds:6.2f} s = "
              f"{count / seconds:6.1f} batches/s", flush=True)
        if epoch > 0:
            totals[name][0] += count
            totals[name][1] += seconds

    # torch forks its (persistent) workers before any gRPC thread exists in this process.
    run("torch", theirs, 0)
    with local_service(2, args.worker_process) as service:
        ours = tds.DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=2,
                              service=service)
        run("tds", ours, 0)
        for epoch in range(1, epochs + 1):
            run("torch", theirs, epoch)
            run("tds", ours, epoch)
    del theirs  # stops torch's persistent workers

    rate = {name: count / seconds for name, (count, seconds) in totals.items()}
    ideal = 2 * 1000 / (item_ms * BATCH)
    print(f"torch.utils.data.DataLoader(num_workers=2):      {rate['torch']:6.1f} batches/s")
    where = "subprocess" if args.worker_process else "in-process"
    print(f"tds.DataLoader, 1 local worker ({where}), 2 processes: {rate['tds']:6.1f} batches/s")
    print(f"ratio tds / torch: {rate['tds'] / rate['torch']:.2f}  (target >= 0.8; two idle "
          f"cores would give ~{ideal:.1f} batches/s)")


if __name__ == "__main__":
    main()

"""LOCAL against ANY reads of 16 MB elements, in the same run.

Two placements of one worker, each read with target_workers="LOCAL" and "ANY":
  (a) the worker runs in this process: LOCAL calls it directly (no socket, no frame), ANY goes
      over the worker's TCP data port on loopback like a remote trainer;
  (b) the worker runs in another process on this host (`python -m torch_dataservice worker`):
      LOCAL reads its data port's Unix socket, ANY its TCP port (worker/data_port.py).
Every reading is timed from its `--warmup`-th element on; MB = 10**6 bytes.

    python benchmarks/local_reads.py            # ~1 minute
    python benchmarks/local_reads.py --elements 40 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, ROOT)

import torch_dataservice as tds  # noqa: E402

MB = 10**6
ELEMENT_BYTES = 16 * 2**20


def make_element(i: int):
    import torch

    return torch.full((ELEMENT_BYTES,), i % 251, dtype=torch.uint8)


def read_mb_per_s(target: str, target_workers: str, elements: int, warmup: int) -> float:
    pipeline = tds.Pipeline.range(elements + warmup).map(make_element).apply(tds.distribute(
        "parallel_epochs", target, compression=None, target_workers=target_workers,
        max_outstanding_requests=4))
    count = 0
    start = 0.0
    for element in pipeline:
        count += 1
        if count == warmup:
            start = time.perf_counter()
        del element
    elapsed = time.perf_counter() - start
    return (count - warmup) * ELEMENT_BYTES / MB / elapsed


def measure(label: str, target: str, args: argparse.Namespace) -> dict[str, float]:
    best = {}
    for target_workers in ("LOCAL", "ANY"):
        runs = [read_mb_per_s(target, target_workers, args.elements, args.warmup)
                for _ in range(args.repeats)]
        best[target_workers] = max(runs)
        print(f"{label:<22} {target_workers:<6} {best[target_workers]:8.0f} MB/s "
              f"(runs: {', '.join(f'{r:.0f}' for r in runs)})", flush=True)
    print(f"{label:<22} LOCAL/ANY = {best['LOCAL'] / best['ANY']:.2f}x", flush=True)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=int, default=24, help="timed elements per reading")
    parser.add_argument("--warmup", type=int, default=2, help="untimed elements first")
    parser.add_argument("--repeats", type=int, default=2, help="readings per case (best kept)")
    parser.add_argument("--processes", type=int, default=1, help="executor processes per worker")
    args = parser.parse_args()

    with tds.DispatchServer(tds.DispatcherConfig(host="127.0.0.1")) as dispatcher:
        with tds.WorkerServer(tds.WorkerConfig(dispatcher.address, host="127.0.0.1",
                                               num_processes=args.processes)):
            measure("same process", dispatcher.target, args)

    with tds.DispatchServer(tds.DispatcherConfig(host="127.0.0.1")) as dispatcher:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p))
        worker = subprocess.Popen(
            [sys.executable, "-m", "torch_dataservice", "--log-level", "WARNING", "worker",
             "--dispatcher", dispatcher.address, "--host", "127.0.0.1",
             "--processes", str(args.processes)],
            env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert worker.stdout is not None
            line = worker.stdout.readline()
            if "serving at" not in line:
                raise RuntimeError(f"worker did not start: {line!r}")
            measure("same host (process)", dispatcher.target, args)
        finally:
            worker.terminate()
            worker.wait(timeout=30)


if __name__ == "__main__":
    main()

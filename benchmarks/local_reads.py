"""LOCAL against ANY reads of 16 MB elements, in the same run.

Two placements of one worker, each read with target_workers="LOCAL" and "ANY":
  (a) the worker runs in this process with `num_processes=0` (its pipelines on threads of this
      process): LOCAL calls it directly and receives the tensors the pipeline made, with no
      encode, copy or decode (wire/inprocess.py); ANY goes over the worker's TCP data port on
      loopback like a remote trainer (the worker encodes each element for it);
  (b) the worker runs in another process on this host (`python -m torch_dataservice worker`,
      `--processes` executor processes): LOCAL reads its data port's Unix socket, ANY its TCP
      port (worker/data_port.py).
Every reading is timed from its `--warmup`-th element on; MB = 10**6 bytes. Each placement
prints LOCAL/ANY against the target: same-process LOCAL reads at least TARGET_RATIO x ANY.
A LOCAL read of (a) costs little more than making the element (a fresh 16 MB tensor): its
figures follow the machine's load more than the others'.

    python benchmarks/local_reads.py            # ~20 s
    python benchmarks/local_reads.py --quick    # ~10 s
    python benchmarks/local_reads.py --elements 40 --repeats 3
"""

from __future__ import annotations

import argparse
import time

from _common import HOST, local_cluster, spawn_server, stop_servers

import torch_dataservice as tds

MB = 10**6
ELEMENT_BYTES = 16 * 2**20
TARGET_RATIO = 3.0  # LOCAL / ANY of placement (a)


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


def measure(label: str, target: str, args: argparse.Namespace, has_target: bool) -> float:
    """Best MB/s of LOCAL and of ANY reads (alternated, so a busy spell of the machine hits
    both); prints them and returns LOCAL/ANY."""
    runs: dict[str, list[float]] = {"LOCAL": [], "ANY": []}
    for _ in range(args.repeats):
        for target_workers, found in runs.items():
            found.append(read_mb_per_s(target, target_workers, args.elements, args.warmup))
    best = {target_workers: max(found) for target_workers, found in runs.items()}
    for target_workers, found in runs.items():
        print(f"{label:<34} {target_workers:<6} {best[target_workers]:8.0f} MB/s "
              f"(runs: {', '.join(f'{r:.0f}' for r in found)})", flush=True)
    ratio = best["LOCAL"] / best["ANY"]
    verdict = (f"target >= {TARGET_RATIO:.0f}x: {'met' if ratio >= TARGET_RATIO else 'NOT met'}"
               if has_target else "no target: the element crosses a process boundary either way")
    print(f"{label:<34} LOCAL/ANY = {ratio:.2f}x ({verdict})", flush=True)
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--elements", type=int, default=None,
                        help="timed elements per reading (default 48, --quick 16)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed elements first")
    parser.add_argument("--repeats", type=int, default=None,
                        help="readings per case, best kept (default 3, --quick 1)")
    parser.add_argument("--quick", action="store_true", help="a short run (~10 s)")
    parser.add_argument("--processes", type=int, default=1,
                        help="executor processes of the worker in another process (b)")
    args = parser.parse_args()
    args.elements = args.elements or (16 if args.quick else 48)
    args.repeats = args.repeats or (1 if args.quick else 3)

    with local_cluster(processes=0) as dispatcher:
        measure("(a) same process, num_processes=0", dispatcher.target, args, True)

    with tds.DispatchServer(tds.DispatcherConfig(host=HOST)) as dispatcher:
        worker, _ = spawn_server(["worker", "--dispatcher", dispatcher.address, "--host", HOST,
                                  "--processes", str(args.processes)])
        try:
            measure(f"(b) same host, {args.processes} exec. proc.", dispatcher.target, args,
                    False)
        finally:
            stop_servers([worker], timeout_s=30)


if __name__ == "__main__":
    main()

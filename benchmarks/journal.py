"""What the fault-tolerant journal costs: the same workloads with it off and on, in one run.

  (a) control plane: dataset registrations + job creations per second (each one journaled
      and fsynced before the reply);
  (b) DYNAMIC epoch elements/s over `Pipeline.range(N)` cut into small splits, so that split
      handout (a journaled GetSplit per split) is as hot as it gets, plus GetSplit/s.

The servers run in this process on 127.0.0.1 (the reader then skips gRPC for the element
path, which makes the dispatcher's share of the time larger, not smaller). Runs alternate
off/on and each figure is the best of `--repeats`, because shared machines are noisy.

    python benchmarks/journal.py            # about a minute
    python benchmarks/journal.py --quick
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time

from _common import ROOT, local_cluster

import torch_dataservice as tds
from torch_dataservice.proto import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc
from torch_dataservice.rpc import channel_to


def control_plane_rate(dispatcher: tds.DispatchServer, n: int, tag: str) -> float:
    stub = dispatcher_pb2_grpc.DispatcherServiceStub(channel_to(dispatcher.address))
    begin = time.perf_counter()
    for i in range(n):
        dataset = common_pb2.DatasetDef(pipeline=b"x" * 200, fingerprint=f"{tag}-{i}")
        dataset_id = stub.GetOrRegisterDataset(
            dispatcher_pb2.GetOrRegisterDatasetRequest(dataset=dataset), timeout=10).dataset_id
        stub.GetOrCreateJob(dispatcher_pb2.GetOrCreateJobRequest(config=common_pb2.JobConfig(
            dataset_id=dataset_id, job_name=f"{tag}-job-{i}")), timeout=10)
    return n / (time.perf_counter() - begin)


def epoch_rate(dispatcher: tds.DispatchServer, n: int, split_size: int,
               tag: str) -> tuple[float, float]:
    pipeline = tds.Pipeline.range(n).with_split_size(split_size).apply(
        tds.distribute(tds.ShardingPolicy.DYNAMIC, dispatcher.target, job_name=f"epoch-{tag}"))
    iterator = iter(pipeline)
    next(iterator)  # executor start-up and the first split are not counted
    begin = time.perf_counter()
    count = 1 + sum(1 for _ in iterator)
    elapsed = time.perf_counter() - begin
    assert count == n, f"epoch delivered {count} of {n}"
    return (n - 1) / elapsed, (n / split_size) / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--elements", type=int, default=None)
    parser.add_argument("--split-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    repeats = args.repeats or (2 if args.quick else 3)
    elements = args.elements or (20_000 if args.quick else 60_000)
    registrations = 100 if args.quick else 300
    best: dict[tuple[str, bool], float] = {}
    for attempt in range(repeats):
        for journal in (False, True):
            work_dir = tempfile.mkdtemp(prefix="tds-journal-bench-", dir=ROOT)
            try:
                with local_cluster(1, args.workers, heartbeat_interval_ms=200,
                                   fault_tolerant_mode=journal,
                                   work_dir=work_dir if journal else None) as dispatcher:
                    tag = f"{attempt}-{journal}"
                    figures = {
                        "registrations+jobs/s": control_plane_rate(dispatcher, registrations,
                                                                   tag)}
                    elements_s, splits_s = epoch_rate(dispatcher, elements, args.split_size,
                                                      tag)
                    figures["DYNAMIC elements/s"] = elements_s
                    figures["GetSplit/s"] = splits_s
            finally:
                shutil.rmtree(work_dir, ignore_errors=True)
            for name, value in figures.items():
                best[name, journal] = max(best.get((name, journal), 0.0), value)
    print(f"journal off vs on: {elements} elements in splits of {args.split_size}, "
          f"{args.workers} workers, {registrations} registrations; best of {repeats}")
    print(f"{'figure':<24}{'off':>12}{'on':>12}{'on/off':>9}")
    for name in ("registrations+jobs/s", "DYNAMIC elements/s", "GetSplit/s"):
        off, on = best[name, False], best[name, True]
        print(f"{name:<24}{off:>12.0f}{on:>12.0f}{on / off:>9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Throughput that grows with the fleet: elements/s against N x the same run's 1-worker rate.

An I/O-bound pipeline, `Pipeline.range(n).map(sleep 10 ms)` (the sleep stands for a storage
read), read under DYNAMIC sharding (`distributed_epoch`, splits of `--split-size` elements) by
  (a) one consumer, and
  (b) 4 consumers sharing one job (`job_name`), each in its own process,
while the fleet grows through 1, 2, 4, 8 and 16 single-process workers. The dispatcher and every
worker are separate processes started through the CLI (`python -m torch_dataservice worker
--processes 1`: a worker front plus one executor process each), as a fleet would be; the
consumers are processes of their own too. The fleet only grows (a new worker joins the next
job), so every worker is started once per run.

Baseline, measured in the same run: the 1-worker rate of the same curve. Each row prints
elements/s, "linear" = N x that rate, and the ratio to it (target: >= 0.9 up to 16 workers).
"ideal" is what the sleep alone allows (N x 1000 / 10 ms) and says how close the 1-worker
baseline itself is to it. A rate is taken between the 10% and the 90% element of the epoch (by
arrival time, all consumers merged), so neither the tasks' start nor the epoch's tail is
counted; every epoch is read to its end and its element count checked (exactly once).
CPU columns (psutil, if importable): CPU seconds per second of wall time used over the epoch by
the dispatcher, the workers (fronts and executors) and the consumers: on a 2-core machine a sum
near 2.0 means the cores, not the service, set the rate.

A diagnostic row reads the largest fleet with the reader's default `max_outstanding_requests`
(the other rows use one outstanding fetch per worker, `--outstanding`).

    python benchmarks/scaling.py --quick          # about a minute on 2 cores
    python benchmarks/scaling.py                  # longer epochs, a few minutes
    python benchmarks/scaling.py --json benchmarks/results/scaling.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from _common import spawn_server, stop_servers

SLEEP_MS = 10.0
CONSUMER_TIMEOUT_S = 120.0  # one epoch of one step, at most


class Sleep:
    """The map: waits `ms` (a storage read), returns the element unchanged."""

    def __init__(self, ms: float) -> None:
        self.seconds = ms / 1000

    def __call__(self, element):
        time.sleep(self.seconds)
        return element


# ============================================================================ processes


class Fleet:
    """A dispatcher and a growing set of single-process workers, all CLI subprocesses."""

    def __init__(self, processes_per_worker: int = 1) -> None:
        self._processes = processes_per_worker
        self.dispatcher: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        # Finished jobs' iterations are collected soon, so their tasks leave the workers.
        self.address = self._spawn(["dispatcher", "--port", "0", "--host", "127.0.0.1",
                                    "--job-gc-timeout-ms", "2000"], dispatcher=True)

    def _spawn(self, args: list[str], dispatcher: bool = False) -> str:
        proc, address = spawn_server(args, start_new_session=True)
        if dispatcher:
            self.dispatcher = proc
        else:
            self.workers.append(proc)
        return address

    def grow(self, n: int) -> float:
        """Start workers until there are `n` (each registered when its start returns);
        returns the seconds it took."""
        began = time.perf_counter()
        missing = n - len(self.workers)
        if missing > 0:
            args = ["worker", "--dispatcher", self.address, "--host", "127.0.0.1",
                    "--processes", str(self._processes)]
            with ThreadPoolExecutor(max_workers=missing) as pool:
                for future in [pool.submit(self._spawn, args)
                               for _ in range(missing)]:
                    future.result()
        return time.perf_counter() - began

    def settle(self, meter: CpuMeter, timeout_s: float = 90.0) -> float:
        """Wait until the workers are idle: a worker's start returns once it is registered,
        while its executor process may still be importing torch. Returns the seconds waited."""
        began = time.perf_counter()
        idle = 0.05 + 0.01 * len(self.workers)  # cores: heartbeats of an idle fleet
        while time.perf_counter() - began < timeout_s:
            before = meter.read({"workers": self.pids()["workers"]})
            if before is None:  # no psutil: a fixed pause per new worker instead
                time.sleep(min(timeout_s, 2.0 + 0.5 * len(self.workers)))
                break
            time.sleep(0.5)
            after = meter.read({"workers": self.pids()["workers"]})
            if (after["workers"] - before["workers"]) / 0.5 < idle:
                break
        return time.perf_counter() - began

    def pids(self) -> dict[str, list[int]]:
        return {"dispatcher": [self.dispatcher.pid] if self.dispatcher else [],
                "workers": [w.pid for w in self.workers]}

    def close(self) -> None:
        stop_servers([*([self.dispatcher] if self.dispatcher else []), *self.workers],
                     timeout_s=20)

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _consumer_main(address: str, conn) -> None:
    """A consumer process: per command, read one epoch of a job and send the arrival times."""
    import torch_dataservice as tds

    conn.send("ready")
    while True:
        command = conn.recv()
        if command is None:
            return
        dataset_id, job_name, outstanding = command
        stamps = []
        try:
            pipeline = tds.from_dataset_id("distributed_epoch", address, dataset_id,
                                           job_name=job_name,
                                           max_outstanding_requests=outstanding)
            for _ in pipeline:
                stamps.append(time.time())
            conn.send(("ok", stamps))
        except Exception as error:  # noqa: BLE001 - reported to the parent
            conn.send(("error", f"{type(error).__name__}: {error}"))


class Consumers:
    """`n` consumer processes, started once and reused by every step."""

    def __init__(self, address: str, n: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conns, self.procs = [], []
        for _ in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_consumer_main, args=(address, child), daemon=True)
            proc.start()
            self._conns.append(parent)
            self.procs.append(proc)
        for conn in self._conns:
            if not conn.poll(CONSUMER_TIMEOUT_S) or conn.recv() != "ready":
                raise RuntimeError("a consumer process did not start")

    def read(self, n: int, dataset_id: str, job_name: str, outstanding: int | None
             ) -> list[float]:
        """`n` consumers read one epoch of job `job_name`; all arrival times, merged."""
        for conn in self._conns[:n]:
            conn.send((dataset_id, job_name, outstanding))
        stamps: list[float] = []
        errors = []
        for conn in self._conns[:n]:
            if not conn.poll(CONSUMER_TIMEOUT_S):
                raise RuntimeError(f"a consumer did not finish {job_name} in "
                                   f"{CONSUMER_TIMEOUT_S:.0f} s")
            status, value = conn.recv()
            if status == "ok":
                stamps += value
            else:
                errors.append(value)
        if errors:
            raise RuntimeError(f"consumer failed: {errors[0]}")
        return sorted(stamps)

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


class CpuMeter:
    """CPU seconds used by groups of process trees between two readings (psutil)."""

    def __init__(self) -> None:
        try:
            import psutil
        except ImportError:
            psutil = None
        self._psutil = psutil

    def read(self, groups: dict[str, list[int]]) -> dict[str, float] | None:
        if self._psutil is None:
            return None
        totals = {}
        for name, pids in groups.items():
            total = 0.0
            for pid in pids:
                with contextlib.suppress(self._psutil.Error):
                    proc = self._psutil.Process(pid)
                    for p in [proc, *proc.children(recursive=True)]:
                        with contextlib.suppress(self._psutil.Error):
                            times = p.cpu_times()
                            total += times.user + times.system
            totals[name] = total
        return totals


# ============================================================================ measuring


@dataclass
class Row:
    consumers: int
    workers: int
    outstanding: int | None
    elements: int
    rate: float  # elements/s between the 10% and 90% elements
    linear: float = 0.0  # workers x this curve's 1-worker rate
    ideal: float = 0.0  # workers x 1000 / SLEEP_MS
    cpu: dict[str, float] = field(default_factory=dict)  # cores used per group
    note: str = ""

    @property
    def ratio(self) -> float:
        return self.rate / self.linear if self.linear else float("nan")


def steady_rate(stamps: list[float]) -> float:
    n = len(stamps)
    lo, hi = int(0.1 * n), int(0.9 * n) - 1
    if hi <= lo or stamps[hi] <= stamps[lo]:
        raise RuntimeError(f"too few elements ({n}) to measure a rate")
    return (hi - lo) / (stamps[hi] - stamps[lo])


def measure(fleet: Fleet, consumers: Consumers, meter: CpuMeter, n_consumers: int,
            n_workers: int, seconds: float, split_size: int, outstanding: int | None,
            tag: str) -> Row:
    import torch_dataservice as tds

    # Enough elements for `seconds` of steady reading at the ideal rate (10%..90% of them).
    elements = max(20 * split_size,
                   int(seconds * n_workers * 1000 / SLEEP_MS / 0.8) // split_size * split_size)
    pipeline = tds.Pipeline.range(elements).with_split_size(split_size).map(Sleep(SLEEP_MS))
    dataset_id = tds.register_dataset(f"grpc://{fleet.address}", pipeline, compression=None)
    groups = {**fleet.pids(), "consumers": [p.pid for p in consumers.procs[:n_consumers]]}
    before, began = meter.read(groups), time.perf_counter()
    stamps = consumers.read(n_consumers, dataset_id, f"scaling-{tag}", outstanding)
    after, wall = meter.read(groups), time.perf_counter() - began
    if len(stamps) != elements:
        raise RuntimeError(f"{tag}: read {len(stamps)} elements of {elements}")
    cpu = {k: (after[k] - before[k]) / wall for k in after} if before and after else {}
    return Row(n_consumers, n_workers, outstanding, elements, steady_rate(stamps),
               ideal=n_workers * 1000 / SLEEP_MS, cpu=cpu)


def print_table(rows: list[Row]) -> None:
    header = (f"{'consumers':>9} {'workers':>7} {'outst.':>6} {'elements/s':>11} "
              f"{'linear':>8} {'ratio':>6} {'vs ideal':>8}  {'cpu disp/workers/cons/sum':>26}")
    print(header)
    print("-" * len(header))
    for row in rows:
        cpu = ""
        if row.cpu:
            cpu = (f"{row.cpu['dispatcher']:.2f}/{row.cpu['workers']:.2f}/"
                   f"{row.cpu['consumers']:.2f}/{sum(row.cpu.values()):.2f}")
        outstanding = "dflt" if row.outstanding is None else str(row.outstanding)
        print(f"{row.consumers:>9} {row.workers:>7} {outstanding:>6} {row.rate:>11,.0f} "
              f"{row.linear:>8,.0f} {row.ratio:>5.2f}x {row.rate / row.ideal:>7.2f}x  "
              f"{cpu:>26}{'  ' + row.note if row.note else ''}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short epochs (about a minute)")
    parser.add_argument("--workers", default="1,2,4,8,16",
                        help="fleet sizes, growing (default: 1,2,4,8,16)")
    parser.add_argument("--consumers", default="1,4",
                        help="consumer counts, one curve each (default: 1,4)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="steady reading per epoch at the ideal rate (quick 2.5, full 8)")
    parser.add_argument("--split-size", type=int, default=10,
                        help="elements per DYNAMIC split (default: 10, i.e. 100 ms of reads)")
    parser.add_argument("--outstanding", default="workers",
                        help="max_outstanding_requests: 'workers' (one fetch per worker, at "
                             "least 4), 'default' (the reader's), or a number")
    parser.add_argument("--no-diagnostic", action="store_true",
                        help="skip the largest fleet read with the default max_outstanding")
    parser.add_argument("--json", default=None, help="write the rows to this JSON file")
    args = parser.parse_args(argv)
    sizes = sorted({int(s) for s in args.workers.split(",")})
    curves = [int(c) for c in args.consumers.split(",")]
    seconds = args.seconds or (2.5 if args.quick else 8.0)

    def outstanding_for(n: int) -> int | None:
        if args.outstanding == "workers":
            return max(4, n)
        return None if args.outstanding == "default" else int(args.outstanding)

    began = time.perf_counter()
    meter = CpuMeter()
    rows: list[Row] = []
    starts: dict[int, float] = {}
    with contextlib.ExitStack() as stack:
        fleet = stack.enter_context(Fleet())
        consumers = Consumers(fleet.address, max(curves))
        stack.callback(consumers.close)
        for n in sizes:
            starts[n] = fleet.grow(n)
            waited = fleet.settle(meter)
            print(f"{n} workers up: {starts[n]:.1f} s until the new ones registered, "
                  f"{waited:.1f} s more until the fleet was idle", flush=True)
            if n == sizes[0]:  # the consumers' first read (imports, connections): not timed
                measure(fleet, consumers, meter, max(curves), n, 0.2, args.split_size,
                        outstanding_for(n), "warm-up")
            for c in curves:
                row = measure(fleet, consumers, meter, c, n, seconds, args.split_size,
                              outstanding_for(n), f"{c}c-{n}w")
                rows.append(row)
                print(f"  {c} consumer(s): {row.rate:,.0f} elements/s", flush=True)
            if n == sizes[-1] and not args.no_diagnostic and outstanding_for(n) is not None:
                row = measure(fleet, consumers, meter, 1, n, seconds, args.split_size, None,
                              f"1c-{n}w-default")
                row.note = "diagnostic: the reader's default max_outstanding_requests"
                rows.append(row)
                print(f"  1 consumer, default max_outstanding_requests: "
                      f"{row.rate:,.0f} elements/s", flush=True)
    for c in curves:
        base = next((r.rate for r in rows if r.consumers == c and r.workers == sizes[0]
                     and r.outstanding == outstanding_for(sizes[0])), None)
        for row in rows:
            if row.consumers == c and base:
                row.linear = base * row.workers / sizes[0]

    print()
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, "
          f"{'quick' if args.quick else 'full'} mode, map sleeps {SLEEP_MS:g} ms, splits of "
          f"{args.split_size}, ~{seconds:g} s per epoch, {time.perf_counter() - began:.0f} s; "
          f"linear = workers x the same curve's {sizes[0]}-worker rate")
    print_table(rows)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "scaling", "cores": os.cpu_count(), "sleep_ms": SLEEP_MS,
                       "split_size": args.split_size, "seconds": seconds,
                       "worker_start_s": starts,
                       "rows": [{**asdict(r), "ratio": r.ratio} for r in rows]}, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())

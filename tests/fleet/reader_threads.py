"""A trainer process with many readers: THREADS threads, each a reader of its own of the one
DYNAMIC job JOB over range(N) (its own Pipeline, so that every thread joins repetition 0 of
the job; one Pipeline iterated twice would start the next repetition). Once every thread has
its Pipeline it prints "ready" and waits for the file GO, so that the readers of every process
start together. Thread t writes what it reads to OUT.t (one element per line, flushed every
64, then "done"); RATE (elements/s per thread, 0: unlimited) stretches the epoch. At the end
it prints "read COUNT in SECONDS s" per thread and "peak rss MB" (VmHWM) of the process; an
error in a thread prints "failed TYPE: MESSAGE" and the process exits 1.

    python -m tests.fleet.reader_threads SERVICE N THREADS JOB OUT GO [RATE]
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch_dataservice as tds

GO_TIMEOUT_S = 120.0


def peak_rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def read(pipeline: tds.Pipeline, out: str, rate: float, go: str,
         failures: list[str]) -> None:
    deadline = time.monotonic() + GO_TIMEOUT_S
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            failures.append(f"no go file {go} after {GO_TIMEOUT_S:.0f} s")
            return
        time.sleep(0.02)
    began = time.monotonic()
    count = 0
    lines: list[str] = []
    try:
        with open(out, "w") as sink:
            for element in pipeline:
                count += 1
                lines.append(f"{int(element)}\n")
                if len(lines) == 64:
                    sink.write("".join(lines))
                    sink.flush()
                    lines.clear()
                if rate:
                    time.sleep(max(0.0, count / rate - (time.monotonic() - began)))
            sink.write("".join(lines) + "done\n")
    except Exception as error:  # what the test asserts on
        failures.append(f"{type(error).__name__}: {error}")
        print(f"failed {type(error).__name__}: {error}", flush=True)
        return
    print(f"read {count} in {time.monotonic() - began:.1f} s", flush=True)


def main() -> int:
    service, n, threads, job, out, go = sys.argv[1:7]
    rate = float(sys.argv[7]) if len(sys.argv) > 7 else 0.0
    pipelines = [tds.Pipeline.range(int(n)).apply(
        tds.distribute("distributed_epoch", service, job_name=job)) for _ in range(int(threads))]
    failures: list[str] = []
    workers = [threading.Thread(target=read, args=(p, f"{out}.{t}", rate, go, failures))
               for t, p in enumerate(pipelines)]
    print("ready", flush=True)
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    print(f"peak rss {peak_rss_mb():.0f} MB", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

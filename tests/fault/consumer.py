"""A consumer process for the fault tests: reads one DYNAMIC epoch of Pipeline.range(N).

Usage: python -m tests.fault.consumer DISPATCHER_ADDRESS N OUT_FILE [JOB_NAME [MAX_RATE
[FLUSH_EVERY]]]
MAX_RATE (elements/s, 0 = unlimited) stretches the epoch so that faults land inside it;
FLUSH_EVERY (default 256) elements are written at a time (1: each as it is taken).
With TDS_TEST_CONSUMER_GO=FILE in the environment it creates OUT_FILE.ready once imported,
then waits for FILE before it reads, so that consumers slow to start (torch's import on a busy
machine) begin together. With TDS_TEST_CONSUMER_CACHE=DIR the pipeline has a `cache()` after a
step that appends each element it computes to a file in DIR (one file per process), so a test
can tell the elements computed from those read back from a worker's cache.
Appends every element it receives to OUT_FILE (one per line, flushed in batches) and writes
a final "done" line when the epoch ended, so the test can count delivered, missing and
duplicated elements even if this process is killed.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from pathlib import Path

import torch_dataservice as tds


def computed(directory: str, x: int) -> int:
    """The step before the cache: notes that `x` was computed (not read from a cache)."""
    with open(os.path.join(directory, str(os.getpid())), "a") as f:
        f.write(f"{x}\n")
    return x


def main() -> int:
    address, n, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    job_name = sys.argv[4] if len(sys.argv) > 4 else "fault-epoch"
    max_rate = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    flush_every = int(sys.argv[6]) if len(sys.argv) > 6 else 256
    cache_dir = os.environ.get("TDS_TEST_CONSUMER_CACHE")
    pipeline = tds.Pipeline.range(n)
    if cache_dir:
        pipeline = pipeline.map(functools.partial(computed, cache_dir)).cache()
    pipeline = pipeline.map(lambda x: x).apply(
        tds.distribute(tds.ShardingPolicy.DYNAMIC, f"grpc://{address}", job_name=job_name))
    go = os.environ.get("TDS_TEST_CONSUMER_GO")
    if go:
        Path(out + ".ready").touch()
        deadline = time.monotonic() + 120
        while not os.path.exists(go):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no go file {go} after 120 s")
            time.sleep(0.02)
    start = time.monotonic()
    count = 0
    with open(out, "w") as f:
        batch = []
        for element in pipeline:
            batch.append(f"{int(element)}\n")
            count += 1
            if len(batch) >= flush_every:
                f.write("".join(batch))
                f.flush()
                batch.clear()
                if max_rate:
                    time.sleep(max(0.0, count / max_rate - (time.monotonic() - start)))
        f.write("".join(batch))
        f.write("done\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A trainer process for tests/integration/test_object_store.py: registers a pipeline over
object storage with a DYNAMIC job and writes what it reads, one line per element, flushed.

Usage: python -m tests.integration.s3_reader DISPATCHER_ADDRESS tar|files URL OUT [MAX_RATE]
`tar`: from_tar_shards(URL), a line "KEY JPG_BYTES" per sample. `files`: list_files(URL) read
with tds.read_bytes on the workers, a line "URL BYTES" per file. A last line "done" when the
epoch ended. MAX_RATE (elements/s, 0 = unlimited) is how fast each worker makes samples (a
pause per sample, on the worker), so that a worker killed after the trainer's first lines is
surely in the middle of a shard: pacing the trainer instead does not, since its prefetch and
the workers' buffers take whole 40-sample shards at once.
"""

from __future__ import annotations

import functools
import sys
import time

import torch_dataservice as tds


def pause(element: str, seconds: float) -> str:
    time.sleep(seconds)
    return element


def main() -> int:
    address, source, url, out = sys.argv[1:5]
    max_rate = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    if source == "tar":
        pipeline = tds.Pipeline.from_tar_shards(url).map(
            lambda sample: f"{sample['__key__']} {len(sample['jpg'])}")
    else:
        pipeline = tds.Pipeline.list_files(url).map(
            lambda path: f"{path} {len(tds.read_bytes(path))}")
    if max_rate:
        pipeline = pipeline.map(functools.partial(pause, seconds=1 / max_rate))
    distributed = pipeline.apply(tds.distribute(tds.ShardingPolicy.DYNAMIC,
                                                f"grpc://{address}"))
    with open(out, "w") as f:
        for line in distributed:
            f.write(line + "\n")
            f.flush()
        f.write("done\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Quickstart: a dispatcher, two workers and a consumer, all in this process (`make run`).

    python examples/quickstart.py

The pipeline (range -> a dict holding a tensor -> batches of 4) runs on the workers; the
consumer reads it with `distributed_epoch`, so the dispatcher hands the input out in splits and
every element arrives exactly once, from one worker or the other. The servers stop on exit.
"""

from __future__ import annotations

import sys
import time

import torch

import torch_dataservice as tds

NUM_ELEMENTS = 24
BATCH_SIZE = 4


def make_example(index: int) -> dict:
    """What a worker computes per element (this function is shipped to the workers)."""
    return {"id": index, "features": torch.full((3,), float(index)) ** 2}


def main() -> int:
    start = time.perf_counter()
    dispatcher = tds.DispatchServer(tds.DispatcherConfig(port=0))
    # One executor process per worker keeps start-up quick; a real worker uses all its cores.
    workers = [tds.WorkerServer(tds.WorkerConfig(dispatcher.address, num_processes=1))
               for _ in range(2)]
    try:
        pipeline = tds.Pipeline.range(NUM_ELEMENTS).map(make_example).batch(BATCH_SIZE)
        distributed = pipeline.apply(tds.distribute("distributed_epoch", dispatcher.target))
        seen: list[int] = []
        batches = 0
        for batch in distributed:
            ids = batch["id"].tolist()
            print(f"batch {batches}: ids={ids} features[0]={batch['features'][0].tolist()}")
            seen += ids
            batches += 1
        complete = sorted(seen) == list(range(NUM_ELEMENTS))
        print(f"read {len(seen)} elements in {batches} batches from {len(workers)} workers "
              f"in {time.perf_counter() - start:.1f}s: "
              f"{'each element exactly once' if complete else 'MISSING OR DUPLICATED elements'}")
        return 0 if complete else 1
    finally:
        for worker in workers:
            worker.stop()
        dispatcher.stop()


if __name__ == "__main__":
    sys.exit(main())

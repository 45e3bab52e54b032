"""Coordinated reads: all consumers get similar-length batches in each round.

Synchronous data-parallel training pads every step to its longest batch: a rank with short
sequences waits for the rank with long ones. Here workers bucket variable-length sequences (sort
a window by length, cut it into batches) and consumers read with `consumer_index` /
`num_consumers`: in each round one worker hands consecutive batches of one bucket to all
consumers, so their lengths match. The same pipeline read without coordination (consumers of
one job take batches first come, first served) is the baseline.

    python examples/coordinated_reads.py
"""

from __future__ import annotations

import os
import random
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script from a checkout without installing
    sys.path.insert(0, ROOT)

import torch_dataservice as tds  # noqa: E402

NUM_SEQUENCES = 4096
NUM_CONSUMERS = 4
BATCH_SIZE = 8
WINDOW = 128  # sequences sorted together (a bucket)


def sequence(i: int) -> list[int]:
    length = random.Random(i).randint(4, 512)
    return [i] * length


def bucket(window: list[list[int]]) -> list[dict]:
    """Sort a window of sequences by length and cut it into padded batches."""
    import torch

    window = sorted(window, key=len)
    batches = []
    for start in range(0, len(window) - BATCH_SIZE + 1, BATCH_SIZE):
        group = window[start:start + BATCH_SIZE]
        longest = max(len(s) for s in group)
        tokens = torch.zeros(len(group), longest, dtype=torch.int64)
        for row, seq in enumerate(group):
            tokens[row, :len(seq)] = torch.tensor(seq)
        batches.append({"tokens": tokens, "lengths": torch.tensor([len(s) for s in group])})
    return batches


def pipeline() -> tds.Pipeline:
    return tds.Pipeline.range(NUM_SEQUENCES).map(sequence).batch(
        WINDOW, collate_fn=list).flat_map(bucket)


def read(service: str, job_name: str, coordinated: bool) -> list[list[int]]:
    """Each consumer's batch lengths (padded length of each batch it received), in order."""
    lengths: list[list[int]] = [[] for _ in range(NUM_CONSUMERS)]

    def consume(i: int) -> None:
        extra = dict(consumer_index=i, num_consumers=NUM_CONSUMERS) if coordinated else {}
        for batch in pipeline().apply(tds.distribute(
                "distributed_epoch", service, job_name=job_name, **extra)):
            lengths[i].append(batch["tokens"].shape[1])

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(NUM_CONSUMERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return lengths


def step_padding(lengths: list[list[int]]) -> tuple[int, int]:
    """(padded tokens, real tokens) when each step pads every consumer to the step's longest."""
    steps = min(len(per_consumer) for per_consumer in lengths)
    padded = real = 0
    for step in range(steps):
        in_step = [per_consumer[step] for per_consumer in lengths]
        padded += max(in_step) * BATCH_SIZE * len(in_step)
        real += sum(in_step) * BATCH_SIZE
    return padded, real


def main() -> None:
    with tds.DispatchServer() as dispatcher, \
            tds.WorkerServer(tds.WorkerConfig(dispatcher.address, num_processes=1)), \
            tds.WorkerServer(tds.WorkerConfig(dispatcher.address, num_processes=1)):
        results = {}
        for name, coordinated in (("uncoordinated", False), ("coordinated", True)):
            lengths = read(dispatcher.target, f"example-{name}", coordinated)
            padded, real = step_padding(lengths)
            results[name] = (padded - real) / padded
            counts = [len(per_consumer) for per_consumer in lengths]
            print(f"{name:>14}: batches per consumer {counts}; step padding "
                  f"{padded - real:,} tokens ({(padded - real) / padded:.1%} of {padded:,})")
        before, after = results["uncoordinated"], results["coordinated"]
        print(f"padding per step: {before:.1%} -> {after:.1%} of the computed tokens "
              f"({1 - after / before:.0%} less padding with coordinated reads)")


if __name__ == "__main__":
    main()

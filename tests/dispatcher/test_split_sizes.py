"""SplitSizes answers as the dict it replaces, and an epoch of equal splits stays a few runs:
in the state, its copy for compaction and its snapshot, whatever the splits read."""

from __future__ import annotations

import pickle
import random

import pytest

from tests.dispatcher.builders import build, one_iteration
from torch_dataservice.dispatcher import snapshot
from torch_dataservice.dispatcher.split_sizes import SplitSizes


@pytest.mark.timeout(60)
def test_split_sizes_answer_as_a_dict_whatever_the_order_and_the_overwrites() -> None:
    rng = random.Random(7)
    for _ in range(200):
        sizes, expected = SplitSizes(), {}
        for _ in range(rng.randrange(1, 60)):
            key = (rng.randrange(2), rng.randrange(40))
            count = rng.choice((10, 10, 10, 3))  # mostly equal counts, some short splits
            sizes[key] = expected[key] = count
        assert dict(sizes.items()) == expected and len(sizes) == len(expected)
        assert all(sizes.get((r, i)) == expected.get((r, i)) for r in range(3)
                   for i in range(-1, 42))
        runs = list(sizes.runs())
        assert all(a[2] <= b[1] for a, b in zip(runs, runs[1:], strict=False) if a[0] == b[0])
        assert all(not (a[0] == b[0] and a[2] == b[1] and a[3] == b[3])
                   for a, b in zip(runs, runs[1:], strict=False))  # neighbours merged
        rebuilt = SplitSizes()
        for run in runs:
            rebuilt.add_run(*run)
        assert rebuilt == sizes


@pytest.mark.timeout(60)
def test_an_epoch_of_equal_splits_stays_a_few_runs_in_the_state_and_its_snapshot() -> None:
    state = build(*one_iteration())
    iteration = next(iter(state.iterations.values()))
    for index in range(100_000):  # in hand-out order, settling a little out of order
        iteration.sizes[0, index ^ 1] = 3 if index == 50_000 else 10
    assert len(iteration.sizes) == 100_000
    assert len(list(iteration.sizes.runs())) == 3
    assert len(pickle.dumps(state)) < 10_000  # the copy compaction takes under the lock
    data = snapshot.to_bytes(state)
    assert len(data) < 10_000  # one entry per split took 1 MB
    restored = snapshot.from_bytes(data).iteration(iteration.iteration_id).sizes
    assert restored == iteration.sizes and restored[0, 50_001] == 3


@pytest.mark.timeout(60)
def test_a_version_2_snapshot_with_one_size_per_split_is_still_read() -> None:
    state = build(*one_iteration())
    iteration = next(iter(state.iterations.values()))
    message = snapshot.to_proto(state)
    message.schema_version = 2
    older = message.iterations[0]
    for index, count in ((0, 10), (1, 10), (5, 4)):
        older.sizes.add(split={"repetition": 0, "index": index}, num_elements=count)
    restored = snapshot.from_proto(message).iteration(iteration.iteration_id).sizes
    assert dict(restored.items()) == {(0, 0): 10, (0, 1): 10, (0, 5): 4}

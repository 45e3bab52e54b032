"""Transforms run locally: values, laziness and argument errors."""

from __future__ import annotations

import collections
import threading
import time

import numpy as np
import pytest
import torch

from torch_dataservice.pipeline import Pipeline

Point = collections.namedtuple("Point", ["x", "y"])


def counting_source(n: int, reads: list[int]) -> Pipeline:
    def factory():
        for i in range(n):
            reads.append(i)
            yield i

    return Pipeline.from_iterable(factory)


def test_map_and_filter() -> None:
    pipeline = Pipeline.range(10).map(lambda x: x * 10).filter(lambda x: x % 20 == 0)
    assert list(pipeline) == [0, 20, 40, 60, 80]


def test_parallel_map_keeps_order_and_uses_threads() -> None:
    threads: set[str] = set()

    def slow(x: int) -> int:
        threads.add(threading.current_thread().name)
        time.sleep(0.01 * (x % 3))
        return -x

    assert list(Pipeline.range(20).map(slow, num_parallel_calls=4)) == [-x for x in range(20)]
    assert len(threads) > 1 and all(name.startswith("tds-map") for name in threads)
    assert list(Pipeline.range(5).map(lambda x: x + 1, num_parallel_calls=-1)) == [1, 2, 3, 4, 5]


def test_parallel_map_propagates_errors() -> None:
    def boom(x: int) -> int:
        if x == 3:
            raise KeyError("three")
        return x

    with pytest.raises(KeyError, match="three"):
        list(Pipeline.range(10).map(boom, num_parallel_calls=2))


def test_batch_default_collate_drop_remainder_and_collate_fn() -> None:
    batches = list(Pipeline.range(5).batch(2))
    assert [b.tolist() for b in batches] == [[0, 1], [2, 3], [4]]
    assert all(isinstance(b, torch.Tensor) for b in batches)
    assert [b.tolist() for b in Pipeline.range(5).batch(2, drop_remainder=True)] == [
        [0, 1],
        [2, 3],
    ]
    assert list(Pipeline.range(5).batch(3, collate_fn=list)) == [[0, 1, 2], [3, 4]]
    dicts = list(Pipeline.from_items([{"a": 1, "s": "x"}, {"a": 2, "s": "y"}]).batch(2))
    assert dicts[0]["a"].tolist() == [1, 2] and dicts[0]["s"] == ["x", "y"]


def test_unbatch_round_trips_nests() -> None:
    elements = [{"t": torch.tensor([i, i]), "n": np.float64(i), "s": str(i)} for i in range(5)]
    out = list(Pipeline.from_items(elements).batch(2).unbatch())
    assert [e["t"].tolist() for e in out] == [[i, i] for i in range(5)]
    assert [float(e["n"]) for e in out] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert [e["s"] for e in out] == ["0", "1", "2", "3", "4"]
    pairs = list(Pipeline.from_items([(i, str(i)) for i in range(3)]).batch(3).unbatch())
    assert [(int(x), s) for x, s in pairs] == [(0, "0"), (1, "1"), (2, "2")]


def test_unbatch_leaves_arrays_lists_and_namedtuples() -> None:
    rows = list(Pipeline.from_items([np.arange(6).reshape(3, 2)]).unbatch())
    assert [r.tolist() for r in rows] == [[0, 1], [2, 3], [4, 5]]
    assert list(Pipeline.from_items([["a", "b"], ["c"]]).unbatch()) == ["a", "b", "c"]
    points = list(Pipeline.from_items([Point(torch.tensor([1, 2]), ["p", "q"])]).unbatch())
    assert [type(p) for p in points] == [Point, Point]
    assert [(int(p.x), p.y) for p in points] == [(1, "p"), (2, "q")]


@pytest.mark.parametrize(
    ("batch", "match"),
    [
        ({"a": torch.zeros(2), "b": torch.zeros(3)}, "different lengths.*'a': 2.*'b': 3"),
        (torch.tensor(1), "0-dimensional"),
        (7, "int"),
    ],
)
def test_unbatch_errors(batch: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        list(Pipeline.from_items([batch]).unbatch())


def test_shuffle_is_a_permutation_that_reshuffles_each_pass() -> None:
    pipeline = Pipeline.range(100).shuffle(10, seed=7)
    first, second = list(pipeline), list(pipeline)
    assert sorted(first) == sorted(second) == list(range(100))
    assert first != list(range(100)) and first != second
    # A fresh object with the same seed replays the same sequence of orders.
    again = Pipeline.range(100).shuffle(10, seed=7)
    assert list(again) == first and list(again) == second
    assert list(Pipeline.range(10).shuffle(1, seed=0)) == list(range(10))
    unseeded = Pipeline.range(50).shuffle(50)
    assert sorted(unseeded) == list(range(50))


def test_shuffle_buffer_bounds_displacement() -> None:
    # An element can only move earlier by at most buffer_size - 1 positions.
    out = list(Pipeline.range(200).shuffle(4, seed=1))
    assert all(out.index(x) >= x - 3 for x in range(200))


def test_flat_map_accepts_iterables_and_pipelines() -> None:
    assert list(Pipeline.range(3).flat_map(lambda x: [x] * x)) == [1, 2, 2]
    assert list(Pipeline.range(3).flat_map(lambda x: Pipeline.range(x).map(lambda y: y + 10))) == [
        10,
        10,
        11,
    ]
    with pytest.raises(TypeError, match="int"):
        list(Pipeline.range(3).flat_map(lambda x: x))


def test_interleave_matches_tf_semantics() -> None:
    # The example from tf.data.Dataset.interleave's documentation.
    out = Pipeline.range(1, 6).interleave(lambda x: [x] * 6, cycle_length=2, block_length=4)
    expected = [1] * 4 + [2] * 4 + [1] * 2 + [2] * 2 + [3] * 4 + [4] * 4 + [3] * 2 + [4] * 2
    assert list(out) == expected + [5] * 6
    ragged = Pipeline.range(1, 4).interleave(lambda x: Pipeline.range(x), cycle_length=3)
    assert list(ragged) == [0, 0, 0, 1, 1, 2]
    one_slot = Pipeline.range(3).interleave(lambda x: [x, x], cycle_length=1)
    assert list(one_slot) == [0, 0, 1, 1, 2, 2]


def test_repeat_counts_and_forever() -> None:
    assert list(Pipeline.range(2).repeat(3)) == [0, 1, 0, 1, 0, 1]
    assert list(Pipeline.range(2).repeat(0)) == []
    assert list(Pipeline.range(2).repeat().take(5)) == [0, 1, 0, 1, 0]
    assert list(Pipeline.range(2).repeat(-1).take(3)) == [0, 1, 0]


def test_repeat_forever_of_an_empty_pass_ends_locally() -> None:
    assert list(Pipeline.range(0).repeat()) == []
    assert list(Pipeline.range(5).filter(lambda x: False).repeat()) == []


def test_take_and_skip() -> None:
    assert list(Pipeline.range(10).take(3)) == [0, 1, 2]
    assert list(Pipeline.range(10).take(-1)) == list(range(10))
    assert list(Pipeline.range(10).take(0)) == []
    assert list(Pipeline.range(5).skip(3)) == [3, 4]
    assert list(Pipeline.range(5).skip(-1)) == []
    assert list(Pipeline.range(5).skip(9)) == []


def test_take_reads_no_element_past_n() -> None:
    reads: list[int] = []
    assert list(counting_source(100, reads).take(3)) == [0, 1, 2]
    assert reads == [0, 1, 2]


def test_shard_keeps_every_nth() -> None:
    assert list(Pipeline.range(10).shard(3, 1)) == [1, 4, 7]
    assert list(Pipeline.range(10).shard(1, 0)) == list(range(10))


def test_apply_returns_what_fn_returns() -> None:
    assert list(Pipeline.range(4).apply(lambda p: p.map(lambda x: -x))) == [0, -1, -2, -3]
    assert Pipeline.range(4).apply(lambda p: "anything") == "anything"


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda p: p.map(3), "map fn must be callable, got 3"),
        (lambda p: p.map(abs, num_parallel_calls=0), "num_parallel_calls.*got 0"),
        (lambda p: p.filter(None), "predicate must be callable, got None"),
        (lambda p: p.batch(-2), "batch_size must be >= 1, got -2"),
        (lambda p: p.batch(0), "batch_size must be >= 1, got 0"),
        (lambda p: p.batch(2, collate_fn="x"), "collate_fn must be callable, got 'x'"),
        (lambda p: p.shuffle(0), "buffer_size must be >= 1, got 0"),
        (lambda p: p.shuffle(4, seed=1.5), "seed must be an int, got 1.5"),
        (lambda p: p.flat_map([]), r"flat_map fn must be callable, got \[\]"),
        (lambda p: p.interleave(abs, cycle_length=0), "cycle_length must be >= 1, got 0"),
        (lambda p: p.interleave(abs, block_length=-1), "block_length must be >= 1, got -1"),
        (lambda p: p.repeat(-3), "count must be >= -1, got -3"),
        (lambda p: p.take(-5), "take n must be >= -1, got -5"),
        (lambda p: p.skip("2"), "skip n must be an int, got '2'"),
        (lambda p: p.shard(0, 0), "num_shards must be >= 1, got 0"),
        (lambda p: p.shard(2, 2), "index must be < num_shards=2, got 2"),
        (lambda p: p.shard(2, -1), "index must be >= 0, got -1"),
        (lambda p: p.prefetch(-1), "buffer_size must be >= 0, got -1"),
        (lambda p: p.apply(5), "apply fn must be callable, got 5"),
    ],
)
def test_invalid_arguments_name_the_value(build, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build(Pipeline.range(3))

"""Split-driven execution: what the worker's split provider makes a pipeline produce."""

from __future__ import annotations

import pytest

from torch_dataservice.pipeline import ExecutionContext, Pipeline


class ScriptedSplits:
    """Hands out a fixed list of split indices per repetition and records every request."""

    def __init__(self, script: dict[int, list[int]]) -> None:
        self.remaining = {rep: list(splits) for rep, splits in script.items()}
        self.requests: list[tuple[int, int]] = []

    def get_split(self, source_index: int, repetition: int) -> int | None:
        self.requests.append((source_index, repetition))
        splits = self.remaining.get(repetition, [])
        return splits.pop(0) if splits else None


class SharedCursor:
    """Like the dispatcher: every split of every repetition goes to exactly one caller."""

    def __init__(self, num_splits: int) -> None:
        self.num_splits = num_splits
        self.next_index: dict[int, int] = {}

    def get_split(self, source_index: int, repetition: int) -> int | None:
        index = self.next_index.get(repetition, 0)
        if index >= self.num_splits:
            return None
        self.next_index[repetition] = index + 1
        return index


def test_source_produces_exactly_its_splits() -> None:
    pipeline = Pipeline.range(10).with_split_size(3)  # splits [0,1,2] [3,4,5] [6,7,8] [9]
    ctx = ExecutionContext(split_provider=ScriptedSplits({0: [3, 1]}))
    assert list(pipeline.map(lambda x: x * 10).iterate(ctx)) == [90, 30, 40, 50]
    assert ctx.split_provider.requests == [(0, 0), (0, 0), (0, 0)]


def test_every_splittable_source_reads_by_split(tmp_path) -> None:
    for name in "abc":
        (tmp_path / name).touch()
    files = Pipeline.list_files(str(tmp_path / "*"))
    ctx = ExecutionContext(split_provider=ScriptedSplits({0: [2, 0]}))
    assert list(files.iterate(ctx)) == [str(tmp_path / "c"), str(tmp_path / "a")]
    items = Pipeline.from_items({"x": list(range(6))}).with_split_size(2)
    ctx = ExecutionContext(split_provider=ScriptedSplits({0: [1]}))
    assert list(items.iterate(ctx)) == [{"x": 2}, {"x": 3}]
    dataset = Pipeline.from_dataset([10, 11, 12, 13]).with_split_size(3)
    ctx = ExecutionContext(split_provider=ScriptedSplits({0: [1]}))
    assert list(dataset.iterate(ctx)) == [13]


def test_current_split_tags_each_element() -> None:
    pipeline = Pipeline.range(6).with_split_size(2)
    ctx = ExecutionContext(split_provider=ScriptedSplits({0: [2, 0], 1: [1]}))
    tagged = [(x, ctx.current_split) for x in pipeline.repeat(2).iterate(ctx)]
    assert tagged == [
        (4, (0, 0, 2)),
        (5, (0, 0, 2)),
        (0, (0, 0, 0)),
        (1, (0, 0, 0)),
        (2, (0, 1, 1)),
        (3, (0, 1, 1)),
    ]
    local = ExecutionContext()
    assert [ctx_split for _ in pipeline.iterate(local) for ctx_split in [local.current_split]] == [
        None
    ] * 6


def test_each_new_pass_of_the_source_is_the_next_repetition() -> None:
    pipeline = Pipeline.range(4).with_split_size(2)
    provider = ScriptedSplits({0: [0], 1: [1], 2: [0, 1]})
    ctx = ExecutionContext(split_provider=provider)
    assert list(pipeline.repeat(2).iterate(ctx)) == [0, 1, 2, 3]
    # A second run of the chain in the same context continues with repetition 2.
    assert list(pipeline.iterate(ctx)) == [0, 1, 2, 3]
    assert sorted(set(rep for _, rep in provider.requests)) == [0, 1, 2]
    assert ctx.source_iterations == {0: 3}


def test_an_empty_pass_does_not_stop_repeat_under_splits() -> None:
    # Other workers took every split of repetitions 0 and 1; this worker still reaches rep 2.
    pipeline = Pipeline.range(4).with_split_size(2)
    ctx = ExecutionContext(split_provider=ScriptedSplits({0: [], 1: [], 2: [1]}))
    assert list(pipeline.repeat(3).iterate(ctx)) == [2, 3]
    forever = ExecutionContext(split_provider=ScriptedSplits({0: [], 1: [0]}))
    assert list(pipeline.repeat().take(2).iterate(forever)) == [0, 1]


def test_repeat_of_a_source_with_no_splits_ends_under_splits() -> None:
    ctx = ExecutionContext(split_provider=ScriptedSplits({}))
    assert list(Pipeline.range(0).repeat().iterate(ctx)) == []


def test_workers_sharing_a_cursor_see_every_element_once() -> None:
    pipeline = Pipeline.range(100).with_split_size(7)
    cursor = SharedCursor(pipeline.num_splits)
    first = pipeline.map(lambda x: x).iterate(ExecutionContext(split_provider=cursor))
    second = pipeline.map(lambda x: x).iterate(ExecutionContext(split_provider=cursor))
    seen: list[int] = []
    live = [first, second]
    while live:  # alternate the two workers until both run out of splits
        for worker in list(live):
            element = next(worker, None)
            if element is None:
                live.remove(worker)
            else:
                seen.append(element)
    assert sorted(seen) == list(range(100))
    assert cursor.next_index == {0: pipeline.num_splits}


def test_inner_pipelines_do_not_consume_outer_splits() -> None:
    pipeline = Pipeline.range(3).with_split_size(1).flat_map(lambda x: Pipeline.range(x))
    provider = ScriptedSplits({0: [2]})
    assert list(pipeline.iterate(ExecutionContext(split_provider=provider))) == [0, 1]
    assert all(rep == 0 for _, rep in provider.requests)


def test_bad_split_index_and_unsplittable_source_are_errors() -> None:
    ctx = ExecutionContext(split_provider=ScriptedSplits({0: [5]}))
    with pytest.raises(ValueError, match="split index 5 out of range.*2 splits"):
        list(Pipeline.range(4).with_split_size(2).iterate(ctx))
    ctx = ExecutionContext(split_provider=ScriptedSplits({0: [0]}))
    with pytest.raises(ValueError, match="not splittable"):
        list(Pipeline.from_iterable(lambda: iter([1])).iterate(ctx))

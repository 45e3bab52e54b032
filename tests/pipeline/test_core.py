"""Pipeline as a value: immutability, queries, repr, pickling, torch DataLoader."""

from __future__ import annotations

import cloudpickle
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from torch_dataservice.pipeline import ExecutionContext, Pipeline
from torch_dataservice.pipeline.sources import RangeSource


def test_transforms_return_new_pipelines() -> None:
    base = Pipeline.range(4)
    mapped = base.map(lambda x: x + 1)
    assert mapped is not base and base.transforms == ()
    assert list(base) == [0, 1, 2, 3] and list(mapped) == [1, 2, 3, 4]
    assert list(mapped) == [1, 2, 3, 4]  # re-iterable


def test_queries_describe_the_source() -> None:
    pipeline = Pipeline.range(1000).map(abs)
    assert pipeline.is_splittable and pipeline.num_splits == 143
    assert isinstance(pipeline.source, RangeSource) and pipeline.split_size == 7
    with pytest.raises(ValueError, match="only a list_files or from_tar_shards source has files"):
        _ = pipeline.files
    resized = pipeline.with_split_size(5)
    assert resized.num_splits == 200 and pipeline.num_splits == 143
    assert resized.transforms == pipeline.transforms
    assert not pipeline.has_shard_hint and not pipeline.is_file_based


def test_repr_shows_the_chain() -> None:
    def double(x: int) -> int:
        return 2 * x

    pipeline = Pipeline.range(10).map(double).batch(4).prefetch(2)
    assert repr(pipeline) == (
        "Pipeline.range(0, 10, 1).map(test_repr_shows_the_chain.<locals>.double)"
        ".batch(4).prefetch(2)"
    )


def test_cloudpickle_round_trip_with_lambdas() -> None:
    offset = 100
    pipeline = (
        Pipeline.from_items(np.arange(20))
        .map(lambda x: int(x) + offset)
        .filter(lambda x: x % 2 == 0)
        .shuffle(5, seed=3)
        .batch(3, collate_fn=list)
        .prefetch(2)
    )
    expected = list(pipeline)
    copy = cloudpickle.loads(cloudpickle.dumps(pipeline))
    assert list(copy) == expected
    assert copy.num_splits == pipeline.num_splits


def test_iterating_does_not_change_the_pickled_bytes() -> None:
    pipeline = Pipeline.range(30).shuffle(10, seed=1).map(lambda x: x)
    before = cloudpickle.dumps(pipeline)
    first_pass = list(pipeline)
    list(pipeline)
    assert cloudpickle.dumps(pipeline) == before
    # A copy starts at the first shuffle order, whatever the original went through.
    assert list(cloudpickle.loads(before)) == first_pass


def test_iterate_with_a_plain_context_is_local_iteration() -> None:
    pipeline = Pipeline.range(5).map(lambda x: x * x)
    assert list(pipeline.iterate(ExecutionContext())) == list(pipeline) == [0, 1, 4, 9, 16]


def test_is_a_torch_iterable_dataset() -> None:
    pipeline = Pipeline.range(6).map(lambda x: torch.tensor([x, -x]))
    assert isinstance(pipeline, IterableDataset)
    elements = list(DataLoader(pipeline, batch_size=None))
    assert [e.tolist() for e in elements] == [[x, -x] for x in range(6)]
    batches = list(DataLoader(Pipeline.range(5), batch_size=2))
    assert [b.tolist() for b in batches] == [[0, 1], [2, 3], [4]]


@pytest.mark.integration
def test_works_in_a_dataloader_worker_process() -> None:
    pipeline = Pipeline.range(4).map(lambda x: x * 3).prefetch(2)
    loader = DataLoader(pipeline, batch_size=None, num_workers=1)
    assert [int(x) for x in loader] == [0, 3, 6, 9]

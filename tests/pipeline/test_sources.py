"""Sources: values, argument errors and split geometry."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from torch_dataservice.pipeline import Pipeline


class Squares(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i * i


class Counting(IterableDataset):
    def __iter__(self):
        return iter(["a", "b"])


def test_range_forms() -> None:
    assert list(Pipeline.range(4)) == [0, 1, 2, 3]
    assert list(Pipeline.range(2, 8, 3)) == [2, 5]
    assert list(Pipeline.range(5, 0, -2)) == [5, 3, 1]
    assert list(Pipeline.range(0)) == []
    assert all(type(x) is int for x in Pipeline.range(3))


@pytest.mark.parametrize(
    ("args", "match"), [((0, 5, 0), "step must not be 0"), ((1.5,), "1.5"), ((True,), "True")]
)
def test_range_rejects_bad_arguments(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Pipeline.range(*args)


def test_from_items_sequence_is_copied() -> None:
    items = [1, "two", None]
    pipeline = Pipeline.from_items(items)
    items.append(4)
    assert list(pipeline) == [1, "two", None]


def test_from_items_slices_arrays_and_tensors_on_dim0() -> None:
    rows = list(Pipeline.from_items(np.arange(6).reshape(3, 2)))
    assert [r.tolist() for r in rows] == [[0, 1], [2, 3], [4, 5]]
    tensor_rows = list(Pipeline.from_items(torch.arange(6).reshape(3, 2)))
    assert all(isinstance(r, torch.Tensor) for r in tensor_rows)
    assert [r.tolist() for r in tensor_rows] == [[0, 1], [2, 3], [4, 5]]


def test_from_items_dict_of_columns_yields_dicts() -> None:
    pipeline = Pipeline.from_items({"x": np.array([1, 2]), "y": ["a", "b"]})
    assert [(int(e["x"]), e["y"]) for e in pipeline] == [(1, "a"), (2, "b")]


@pytest.mark.parametrize(
    ("items", "match"),
    [
        ({"x": [1, 2], "y": [1]}, "unequal lengths.*'x': 2.*'y': 1"),
        ("abc", "'abc'"),
        ((i for i in range(3)), "generator"),
        (np.float32(3.0), "at least one dimension|float32"),
        ({}, "empty dict"),
    ],
)
def test_from_items_rejects_bad_items(items: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Pipeline.from_items(items)


def test_list_files_sorted_patterns_and_paths(tmp_path) -> None:
    for name in ["b.txt", "a.txt", "c.bin"]:
        (tmp_path / name).write_text(name)
    txt = Pipeline.list_files(str(tmp_path / "*.txt"))
    assert list(txt) == [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    assert txt.is_file_based and txt.files == list(txt)
    both = Pipeline.list_files([str(tmp_path / "*.bin"), tmp_path / "a.txt"])
    assert list(both) == [str(tmp_path / "a.txt"), str(tmp_path / "c.bin")]
    assert not Pipeline.range(3).is_file_based


def test_list_files_seeded_shuffle_is_a_deterministic_permutation(tmp_path) -> None:
    for i in range(20):
        (tmp_path / f"{i:02d}.txt").touch()
    pattern = str(tmp_path / "*.txt")
    ordered = list(Pipeline.list_files(pattern))
    shuffled = list(Pipeline.list_files(pattern, shuffle=True, seed=3))
    assert shuffled == list(Pipeline.list_files(pattern, shuffle=True, seed=3))
    assert shuffled != ordered and sorted(shuffled) == ordered
    assert sorted(Pipeline.list_files(pattern, shuffle=True)) == ordered


def test_list_files_no_match_names_the_pattern(tmp_path) -> None:
    (tmp_path / "a.txt").touch()
    missing = str(tmp_path / "*.csv")
    with pytest.raises(ValueError, match="no files match.*csv"):
        Pipeline.list_files([str(tmp_path / "*.txt"), missing])
    with pytest.raises(ValueError, match="empty list"):
        Pipeline.list_files([])
    with pytest.raises(ValueError, match="seed.*'x'"):
        Pipeline.list_files(str(tmp_path / "*.txt"), shuffle=True, seed="x")


def test_from_dataset_reads_every_index() -> None:
    pipeline = Pipeline.from_dataset(Squares(5))
    assert list(pipeline) == [0, 1, 4, 9, 16]
    assert pipeline.is_splittable


def test_from_dataset_rejects_non_map_style() -> None:
    with pytest.raises(ValueError, match="IterableDataset"):
        Pipeline.from_dataset(Counting())
    with pytest.raises(ValueError, match="__len__"):
        Pipeline.from_dataset(type("NoLen", (), {"__getitem__": lambda self, i: i})())


def test_from_iterable_calls_the_factory_per_iteration() -> None:
    calls = []

    def factory():
        calls.append(1)
        return iter([1, 2])

    pipeline = Pipeline.from_iterable(factory)
    assert list(pipeline) == [1, 2] and list(pipeline) == [1, 2]
    assert len(calls) == 2
    assert list(Pipeline.from_iterable(Counting())) == ["a", "b"]


def test_from_iterable_is_not_splittable() -> None:
    pipeline = Pipeline.from_iterable(lambda: iter([]))
    assert not pipeline.is_splittable
    with pytest.raises(ValueError, match="not splittable"):
        _ = pipeline.num_splits
    with pytest.raises(ValueError, match="not splittable"):
        pipeline.with_split_size(1)
    with pytest.raises(ValueError, match="42"):
        Pipeline.from_iterable(42)


@pytest.mark.parametrize(
    ("n", "split_size", "num_splits"),
    [(0, 1, 0), (10, 1, 10), (1000, 7, 143), (128 * 300, 256, 150)],
)
def test_default_split_size(n: int, split_size: int, num_splits: int) -> None:
    for pipeline in (
        Pipeline.range(n),
        Pipeline.from_items(list(range(n))),
        Pipeline.from_dataset(Squares(n)),
    ):
        assert (pipeline.split_size, pipeline.num_splits) == (split_size, num_splits)


def test_list_files_has_one_file_per_split_and_split_size_is_settable(tmp_path) -> None:
    for i in range(300):
        (tmp_path / f"{i:03d}").touch()
    files = Pipeline.list_files(str(tmp_path / "*"))
    assert (files.split_size, files.num_splits) == (1, 300)
    resized = Pipeline.range(10).with_split_size(3)
    assert (resized.split_size, resized.num_splits) == (3, 4)
    assert list(resized) == list(range(10))
    with pytest.raises(ValueError, match="split_size must be >= 1, got 0"):
        Pipeline.range(10).with_split_size(0)

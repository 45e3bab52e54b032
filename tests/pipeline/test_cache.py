"""`cache()` run locally and its stores: later steps re-run, a changed pipeline never reads
stale entries, a pass cut short is never kept, eviction beyond max_bytes, invalid arguments."""

from __future__ import annotations

import errno
import itertools
import os
import random

import numpy as np
import pytest
import torch

from torch_dataservice.pipeline import ExecutionContext, Pipeline
from torch_dataservice.pipeline.cache import (
    COUNTS,
    CachedDataset,
    DirectoryStore,
    decode_entry,
    encode_element,
    fingerprint,
)
from torch_dataservice.pipeline.split_cursor import LocalSplitCursor


class Calls:
    """A pre-cache function that counts its calls."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, x: int) -> int:
        self.count += 1
        return x * 10


def test_the_chain_before_the_cache_runs_once_and_later_steps_every_pass() -> None:
    calls = Calls()
    pipeline = Pipeline.range(20).map(calls).cache().map(lambda x: x + random.random())
    first, second = list(pipeline), list(pipeline)
    assert calls.count == 20
    assert [int(x) for x in first] == [int(x) for x in second] == [x * 10 for x in range(20)]
    assert first != second  # the random step after the cache ran again


def test_a_pass_cut_short_is_not_kept() -> None:
    calls = Calls()
    pipeline = Pipeline.range(10).map(calls).cache()
    assert list(itertools.islice(iter(pipeline), 3)) == [0, 10, 20]
    assert list(pipeline.take(5)) == [0, 10, 20, 30, 40]
    assert list(pipeline) == [x * 10 for x in range(10)]  # computed whole, not the 3 or 5
    assert list(pipeline) == [x * 10 for x in range(10)]
    assert calls.count == 3 + 5 + 10


def test_a_changed_pipeline_reads_no_stale_entry(tmp_path) -> None:
    def times_ten(x: int) -> int:
        return x * 10

    assert list(Pipeline.range(5).map(times_ten).cache(tmp_path)) == [0, 10, 20, 30, 40]

    def times_ten(x: int) -> int:  # noqa: F811  the same name, another body
        return x * 100

    assert list(Pipeline.range(5).map(times_ten).cache(tmp_path)) == [0, 100, 200, 300, 400]
    assert list(Pipeline.range(6).map(times_ten).cache(tmp_path))[-1] == 500
    (tmp_path / "a").write_text("")
    (tmp_path / "b").write_text("")
    files_a = Pipeline.list_files([str(tmp_path / "a")])
    files_b = Pipeline.list_files([str(tmp_path / "b")])
    assert fingerprint(files_a.source, ()) != fingerprint(files_b.source, ())


def test_the_fingerprint_is_the_same_for_the_same_pipeline_built_twice() -> None:
    def build() -> Pipeline:
        return Pipeline.range(7).map(lambda x: x + 1).filter(bool)

    a, b = build(), build()
    assert fingerprint(a.source, a.transforms) == fingerprint(b.source, b.transforms)
    c = Pipeline.range(7).map(lambda x: x + 2).filter(bool)
    assert fingerprint(a.source, a.transforms) != fingerprint(c.source, c.transforms)


_CALLED: list[int] = []


def _counted(x: int) -> int:  # pickled by reference: its calls are not part of the key
    _CALLED.append(x)
    return x * 10


def test_a_directory_cache_is_shared_by_pipelines_built_again(tmp_path) -> None:
    _CALLED.clear()
    assert list(Pipeline.range(4).map(_counted).cache(tmp_path)) == [0, 10, 20, 30]
    assert list(Pipeline.range(4).map(_counted).cache(tmp_path)) == [0, 10, 20, 30]
    assert _CALLED == [0, 1, 2, 3]


def test_split_by_split_each_split_is_an_entry_keyed_by_its_index(tmp_path) -> None:
    calls = Calls()
    pipeline = Pipeline.range(10).with_split_size(3).map(calls).cache(tmp_path)
    used = []

    def run() -> list[int]:
        ctx = ExecutionContext(split_provider=_Cursor(4), cache_used=lambda *u: used.append(u))
        return list(pipeline.iterate(ctx))

    assert run() == [x * 10 for x in range(10)]
    assert run() == [x * 10 for x in range(10)]
    assert calls.count == 10
    (directory, fp), = set(used)
    assert sorted(os.listdir(os.path.join(directory, fp))) == ["0", "1", "2", "3"]


def test_split_by_split_refuses_steps_that_cross_splits() -> None:
    pipeline = Pipeline.range(10).with_split_size(3).batch(2).cache()
    with pytest.raises(ValueError, match=r"cache\(\) after batch\(2\)"):
        list(pipeline.iterate(ExecutionContext(split_provider=_Cursor(4))))
    assert len(list(pipeline)) == 5  # locally (one whole pass) it is fine


def test_max_bytes_evicts_the_least_recently_used_entries(tmp_path) -> None:
    def pipeline(max_bytes: int | None) -> Pipeline:
        return Pipeline.range(40).with_split_size(10).map(
            lambda x: np.full(100, x, dtype=np.uint8)).cache(tmp_path, max_bytes=max_bytes)

    def run(max_bytes: int | None) -> list[str]:
        used = []
        ctx = ExecutionContext(split_provider=_Cursor(4), cache_used=lambda *u: used.append(u))
        assert len(list(pipeline(max_bytes).iterate(ctx))) == 40
        return sorted(os.listdir(os.path.join(*used[0])))

    entry = len(b"".join(encode_element(np.full(100, 0, dtype=np.uint8)) for _ in range(10)))
    COUNTS.take()
    assert run(int(2.5 * entry)) == ["2", "3"]  # the two used last
    assert COUNTS.take() == (0, 4, 2)
    assert DirectoryStore(str(tmp_path)).nbytes() <= 2.5 * entry


def test_an_entry_larger_than_max_bytes_is_not_kept_and_counted() -> None:
    COUNTS.take()
    calls = Calls()
    pipeline = Pipeline.range(100).map(calls).cache(max_bytes=50)
    list(pipeline), list(pipeline)
    assert calls.count == 200
    hits, misses, evictions = COUNTS.take()
    assert (hits, misses, evictions) == (0, 2, 2)


def test_a_full_disk_evicts_and_never_fails(tmp_path, monkeypatch) -> None:
    store = DirectoryStore(str(tmp_path))
    assert store.put("f", "0", b"x" * 100, None) == 0
    real_open = open
    failures = iter([True, False])

    def full_once(path, mode="r", *args, **kwargs):
        if "w" in mode and ".tmp-" in str(path) and next(failures, False):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", full_once)
    assert store.put("f", "1", b"y" * 100, None) == 1  # entry 0 made room
    assert store.get("f", "0") is None and store.get("f", "1") == b"y" * 100
    monkeypatch.setattr("builtins.open", lambda path, mode="r", *a, **k: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "full")) if "w" in mode else real_open(path, mode, *a, **k))
    assert store.put("f", "2", b"z", None) == 2  # evicts entry 1, then gives up on this one


def test_elements_read_back_as_they_were_written() -> None:
    element = {"image": torch.arange(12, dtype=torch.uint8).reshape(3, 4)[:, 1:],
               "half": torch.ones(2, dtype=torch.bfloat16), "label": 3, "name": "a"}
    (back,) = decode_entry(encode_element(element))
    assert torch.equal(back["image"], element["image"]) and back["half"].dtype == torch.bfloat16
    assert (back["label"], back["name"]) == (3, "a")


@pytest.mark.parametrize("kwargs, match", [
    ({"location": 3}, "cache location must be None or a directory path, got 3"),
    ({"location": ""}, "got ''"),
    ({"max_bytes": 0}, "cache max_bytes must be >= 1, got 0"),
    ({"max_bytes": "1G"}, "cache max_bytes must be an int, got '1G'"),
])
def test_invalid_arguments_name_the_value(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        Pipeline.range(3).cache(**kwargs)


def test_a_file_as_location_is_refused(tmp_path) -> None:
    path = tmp_path / "file"
    path.write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        Pipeline.range(3).cache(path)


class _Cursor:
    """A split provider handing out every split of a pass (as the dispatcher would)."""

    def __init__(self, num_splits: int) -> None:
        self._cursor = LocalSplitCursor(num_splits)

    def get_split(self, source_index: int, repetition: int) -> int | None:
        return self._cursor.next(repetition)


class _Images(torch.utils.data.Dataset):
    loads: list[int] = []

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> torch.Tensor:
        _Images.loads.append(index)
        return torch.full((2,), index)


def test_a_cached_dataset_loads_each_index_once_and_transforms_every_time() -> None:
    _Images.loads.clear()
    dataset = CachedDataset(_Images(), lambda t: t + torch.rand(2))
    first = [dataset[i] for i in (3, 1, 5)]
    again = [dataset[i] for i in (5, 3, 1)]
    assert _Images.loads == [3, 1, 5]
    assert torch.equal(first[0].floor(), again[1].floor()) and not torch.equal(first[0], again[1])
    assert len(dataset) == 6
    with pytest.raises(ValueError, match="transform must be callable, got 3"):
        CachedDataset(_Images(), 3)


def test_file_shards_of_one_pipeline_never_read_each_others_entry(tmp_path) -> None:
    from torch_dataservice.pipeline.sharding import shard_data, shard_files

    files = []
    for i in range(4):
        (tmp_path / f"f{i}").write_text(str(i))
        files.append(str(tmp_path / f"f{i}"))
    store = tmp_path / "cache"
    pipeline = Pipeline.list_files(files).map(lambda p: open(p).read()).cache(store)
    for _ in range(2):  # computed, then read back: each worker's own files
        assert list(shard_files(pipeline, 2, 0)) == ["0", "2"]
        assert list(shard_files(pipeline, 2, 1)) == ["1", "3"]
    # DATA: the shard comes after the cache, whose entry is the whole (shared) pass.
    assert list(shard_data(pipeline, 2, 1)) == ["1", "3"]
    assert len(os.listdir(store)) == 3


def _module_level(x: int) -> int:
    return x


def test_a_module_function_whose_code_changed_changes_the_key() -> None:
    # cloudpickle names an importable function by reference: its body must count anyway.
    pipeline = Pipeline.range(3).map(_module_level)
    before = fingerprint(pipeline.source, pipeline.transforms)
    code = _module_level.__code__
    try:
        _module_level.__code__ = (lambda x: x + 1).__code__
        assert fingerprint(pipeline.source, pipeline.transforms) != before
    finally:
        _module_level.__code__ = code
    assert fingerprint(pipeline.source, pipeline.transforms) == before

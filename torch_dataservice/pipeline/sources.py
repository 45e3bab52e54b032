"""Source nodes: the root of every pipeline chain.

Splittable sources describe their elements as `num_elements` items addressed by index and cut into
contiguous splits of `split_size` items. Without a split provider they produce everything; with one,
they produce exactly the splits the provider hands out (DYNAMIC sharding). An item is one element,
except in a source of files of many elements each (tar shards): there an item is a file.
"""

from __future__ import annotations

import dataclasses
import os
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset

from torch_dataservice.pipeline._checks import callable_name, check_int, check_optional_int
from torch_dataservice.pipeline.context import ExecutionContext
from torch_dataservice.pipeline.storage import glob

#: Splits are capped so that a worker asks the dispatcher for more work often enough to balance
#: load, and floored at 1/128 of the source so small sources still spread over many workers.
MAX_DEFAULT_SPLIT_SIZE = 256


def default_split_size(num_elements: int) -> int:
    """Elements per split when the user did not choose: max(1, min(256, n // 128))."""
    return max(1, min(MAX_DEFAULT_SPLIT_SIZE, num_elements // 128))


class Source(ABC):
    """Root node of a chain; `iterate` produces its elements under a context."""

    splittable: bool = False
    file_based: bool = False

    @abstractmethod
    def iterate(self, ctx: ExecutionContext, source_index: int = 0) -> Iterator[Any]:
        """Produce this source's elements for one pass under `ctx`."""

    @abstractmethod
    def describe(self) -> str:
        """Short text for `Pipeline.__repr__`."""

    def __repr__(self) -> str:
        # Not the dataclass repr: that would print whole arrays and datasets.
        return self.describe()


@dataclass(frozen=True, eq=False, repr=False)
class SplittableSource(Source):
    """A source of `num_elements` indexable elements, cut into contiguous splits."""

    splittable = True
    #: False where an item is a file of many elements: `num_elements` then counts files.
    one_element_per_item = True

    #: Elements per split; None picks `default_split_size(num_elements)`.
    split_size: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.split_size is None:
            object.__setattr__(self, "split_size", self._default_split_size())
        else:
            check_int("split_size", self.split_size, minimum=1)

    def _default_split_size(self) -> int:
        return default_split_size(self.num_elements)

    @property
    @abstractmethod
    def num_elements(self) -> int:
        """How many items (elements, see `one_element_per_item`) one full pass produces."""

    @abstractmethod
    def elements(self, start: int, stop: int) -> Iterator[Any]:
        """The elements of the items with indices in [start, stop)."""

    @property
    def num_splits(self) -> int:
        assert self.split_size is not None
        return -(-self.num_elements // self.split_size)

    def split_bounds(self, split_index: int) -> tuple[int, int]:
        """[start, stop) element indices of split `split_index`."""
        if not 0 <= split_index < self.num_splits:
            raise ValueError(
                f"split index {split_index!r} out of range for a source with "
                f"{self.num_splits} splits"
            )
        assert self.split_size is not None
        start = split_index * self.split_size
        return start, min(start + self.split_size, self.num_elements)

    def with_split_size(self, split_size: int) -> SplittableSource:
        check_int("split_size", split_size, minimum=1)
        return dataclasses.replace(self, split_size=split_size)

    def iterate(self, ctx: ExecutionContext, source_index: int = 0) -> Iterator[Any]:
        provider = ctx.split_provider
        if provider is None:
            yield from self.elements(0, self.num_elements)
            return
        repetition = ctx.next_repetition(source_index)
        while (split_index := provider.get_split(source_index, repetition)) is not None:
            start, stop = self.split_bounds(split_index)
            ctx.current_split = (source_index, repetition, split_index)
            yield from self.elements(start, stop)


@dataclass(frozen=True, eq=False, repr=False)
class RangeSource(SplittableSource):
    start: int
    stop: int
    step: int = 1

    def __post_init__(self) -> None:
        check_int("start", self.start)
        check_int("stop", self.stop)
        if check_int("step", self.step) == 0:
            raise ValueError(f"step must not be 0, got {self.step!r}")
        super().__post_init__()

    @property
    def _range(self) -> range:
        return range(self.start, self.stop, self.step)

    @property
    def num_elements(self) -> int:
        return len(self._range)

    def elements(self, start: int, stop: int) -> Iterator[int]:
        return iter(self._range[start:stop])

    def describe(self) -> str:
        return f"range({self.start}, {self.stop}, {self.step})"


def _column_length(name: str, column: Any) -> int:
    if isinstance(column, (str, bytes)):
        raise ValueError(f"{name} must be a sequence, array or tensor, got the string {column!r}")
    if isinstance(column, (np.ndarray, torch.Tensor)) and column.ndim == 0:
        raise ValueError(f"{name} must have at least one dimension to slice, got a scalar")
    if isinstance(column, Mapping) or not hasattr(column, "__getitem__"):
        raise ValueError(
            f"{name} must be a sequence, array or tensor, got {type(column).__name__} "
            "(use Pipeline.from_iterable for iterators)"
        )
    try:
        return len(column)
    except TypeError:
        raise ValueError(f"{name} has no length: {type(column).__name__}") from None


def _frozen(column: Any) -> Any:
    # Copy lists so later mutation by the caller cannot change the pipeline; arrays and tensors
    # may be large and are kept by reference.
    return tuple(column) if isinstance(column, list) else column


@dataclass(frozen=True, eq=False, repr=False)
class ItemsSource(SplittableSource):
    """tf `from_tensor_slices`: a sequence, an array/tensor sliced on dim 0, or a dict of
    equal-length columns (yielding dicts)."""

    items: Any

    def __post_init__(self) -> None:
        if isinstance(self.items, Mapping):
            if not self.items:
                raise ValueError("from_items got an empty dict: it needs at least one column")
            lengths = {
                key: _column_length(f"column {key!r}", column) for key, column in self.items.items()
            }
            if len(set(lengths.values())) > 1:
                raise ValueError(f"from_items columns have unequal lengths: {lengths}")
            object.__setattr__(
                self, "items", {key: _frozen(column) for key, column in self.items.items()}
            )
        else:
            _column_length("items", self.items)
            object.__setattr__(self, "items", _frozen(self.items))
        super().__post_init__()

    @property
    def num_elements(self) -> int:
        if isinstance(self.items, dict):
            return len(next(iter(self.items.values())))
        return len(self.items)

    def elements(self, start: int, stop: int) -> Iterator[Any]:
        if isinstance(self.items, dict):
            for i in range(start, stop):
                yield {key: column[i] for key, column in self.items.items()}
        else:
            for i in range(start, stop):
                yield self.items[i]

    def describe(self) -> str:
        kind = "dict" if isinstance(self.items, dict) else type(self.items).__name__
        return f"from_items(<{kind} of {self.num_elements}>)"


def resolve_files(
    pattern_or_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
    shuffle: bool = False,
    seed: int | None = None,
    what: str = "list_files",
) -> tuple[str, ...]:
    """Expand glob patterns (local, or fsspec URLs) once, eagerly, so every worker sees the same
    file list: the list, not the pattern, travels in the pipeline."""
    if isinstance(pattern_or_paths, (str, os.PathLike)):
        patterns = [os.fspath(pattern_or_paths)]
    else:
        patterns = [os.fspath(p) for p in pattern_or_paths]
        if not patterns:
            raise ValueError(f"{what} got an empty list of patterns")
    seed = check_optional_int("seed", seed)
    files: set[str] = set()
    for pattern in patterns:
        matches = glob(pattern)
        if not matches:
            raise ValueError(f"{what}: no files match pattern {pattern!r}")
        files.update(matches)
    ordered = sorted(files)
    if shuffle:
        random.Random(seed).shuffle(ordered)
    return tuple(ordered)


@dataclass(frozen=True, eq=False, repr=False)
class FilesSource(SplittableSource):
    """A resolved list of files (paths or URLs): one file per split unless chosen otherwise,
    and FILE sharding gives a worker files[index::num_workers]."""

    file_based = True

    files: tuple[str, ...]

    def _default_split_size(self) -> int:
        return 1

    @property
    def num_elements(self) -> int:
        return len(self.files)


@dataclass(frozen=True, eq=False, repr=False)
class ListFilesSource(FilesSource):
    """The files' paths or URLs themselves."""

    def elements(self, start: int, stop: int) -> Iterator[str]:
        return iter(self.files[start:stop])

    def describe(self) -> str:
        return f"list_files(<{len(self.files)} files>)"


@dataclass(frozen=True, eq=False, repr=False)
class DatasetSource(SplittableSource):
    """A map-style dataset read as `dataset[i]` for i in range(len(dataset))."""

    dataset: Any
    length: int = field(init=False)

    def __post_init__(self) -> None:
        if isinstance(self.dataset, IterableDataset):
            raise ValueError(
                f"from_dataset needs a map-style dataset, got the IterableDataset "
                f"{self.dataset!r}; use Pipeline.from_iterable"
            )
        if not hasattr(self.dataset, "__getitem__"):
            raise ValueError(f"from_dataset needs __getitem__, got {self.dataset!r}")
        try:
            length = len(self.dataset)
        except TypeError:
            raise ValueError(f"from_dataset needs __len__, got {self.dataset!r}") from None
        object.__setattr__(self, "length", length)
        super().__post_init__()

    @property
    def num_elements(self) -> int:
        return self.length

    def elements(self, start: int, stop: int) -> Iterator[Any]:
        for i in range(start, stop):
            yield self.dataset[i]

    def describe(self) -> str:
        return f"from_dataset(<{type(self.dataset).__name__} of {self.length}>)"


@dataclass(frozen=True, eq=False, repr=False)
class IterableSource(Source):
    """A zero-argument factory of iterators, or a torch IterableDataset. Not splittable."""

    factory: Callable[[], Any] | IterableDataset

    def __post_init__(self) -> None:
        if not isinstance(self.factory, IterableDataset) and not callable(self.factory):
            raise ValueError(
                "from_iterable needs a zero-argument callable returning an iterator, or a "
                f"torch IterableDataset, got {self.factory!r}"
            )

    def iterate(self, ctx: ExecutionContext, source_index: int = 0) -> Iterator[Any]:
        if ctx.split_provider is not None:
            raise ValueError(
                f"{self.describe()} is not splittable and cannot be read from a split provider"
            )
        if isinstance(self.factory, IterableDataset):
            return iter(self.factory)
        return iter(self.factory())

    def empty_pass_ends(self) -> bool:
        """A factory may say that its last pass was empty only because others consumed it
        (a shared job read through the service): then a `repeat()` goes on."""
        ends = getattr(self.factory, "empty_pass_ends", None)
        return ends() if callable(ends) else True

    def describe(self) -> str:
        return f"from_iterable({callable_name(self.factory)})"

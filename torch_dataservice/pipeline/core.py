"""`Pipeline`: an immutable, picklable description of an input pipeline.

A pipeline is one source node followed by a tuple of transform nodes. Describing it does no work;
`iterate(ctx)` runs the chain under an execution context (a worker passes its split provider),
and `iter(pipeline)` runs it locally, which also makes it a torch `IterableDataset`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from torch.utils.data import IterableDataset

from torch_dataservice.pipeline._checks import check_callable
from torch_dataservice.pipeline.cache import Cache
from torch_dataservice.pipeline.context import ExecutionContext
from torch_dataservice.pipeline.prefetch import Prefetch
from torch_dataservice.pipeline.sharding import Shard
from torch_dataservice.pipeline.sources import (
    DatasetSource,
    FilesSource,
    ItemsSource,
    IterableSource,
    ListFilesSource,
    RangeSource,
    Source,
    SplittableSource,
    resolve_files,
)
from torch_dataservice.pipeline.tar_shards import TarShardsSource
from torch_dataservice.pipeline.transforms import (
    Batch,
    Filter,
    FlatMap,
    Interleave,
    Map,
    Repeat,
    Shuffle,
    Skip,
    Take,
    Transform,
    Unbatch,
    Upstream,
)


class Pipeline(IterableDataset):
    """A lazily described input pipeline; every transform returns a new Pipeline.

    Build one with a source (`Pipeline.range`, `from_items`, `list_files`, `from_tar_shards`,
    `from_dataset`, `from_iterable`) rather than the constructor.
    """

    def __init__(self, source: Source, transforms: Iterable[Transform] = ()) -> None:
        if not isinstance(source, Source):
            raise ValueError(f"a Pipeline needs a source node, got {source!r}")
        transforms = tuple(transforms)
        for transform in transforms:
            if not isinstance(transform, Transform):
                raise ValueError(f"not a transform node: {transform!r}")
        self._source = source
        self._transforms = transforms

    # ----------------------------------------------------------------------------- sources

    @classmethod
    def range(cls, start_or_stop: int, stop: int | None = None, step: int = 1) -> Pipeline:
        """`range(stop)` or `range(start, stop, step=1)`, as Python ints."""
        if stop is None:
            return cls(RangeSource(0, start_or_stop, step))
        return cls(RangeSource(start_or_stop, stop, step))

    @classmethod
    def from_items(cls, items: Any) -> Pipeline:
        """Elements of a sequence, rows of an array/tensor, or dicts from a dict of columns."""
        return cls(ItemsSource(items))

    @classmethod
    def list_files(
        cls,
        pattern_or_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        shuffle: bool = False,
        seed: int | None = None,
    ) -> Pipeline:
        """Local paths, or fsspec URLs (`s3://...`), matching the glob pattern(s), listed now
        (once: the list travels with the pipeline); sorted, or permuted once (deterministically
        when `seed` is given) if `shuffle`."""
        return cls(ListFilesSource(resolve_files(pattern_or_paths, shuffle, seed)))

    @classmethod
    def from_tar_shards(
        cls,
        urls_or_pattern: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        shuffle: bool = False,
        seed: int | None = None,
    ) -> Pipeline:
        """Samples of tar shards in the WebDataset layout, as dicts `{"__key__", "__url__",
        EXT: bytes, ...}`; the shards are listed now, as `list_files` lists, and each shard
        is a split (DYNAMIC) or a file (FILE sharding)."""
        files = resolve_files(urls_or_pattern, shuffle, seed, what="from_tar_shards")
        return cls(TarShardsSource(files))

    @classmethod
    def from_dataset(cls, dataset: Any) -> Pipeline:
        """`dataset[i]` for i in range(len(dataset)) of a map-style dataset."""
        return cls(DatasetSource(dataset))

    @classmethod
    def from_iterable(cls, factory: Callable[[], Iterable[Any]] | IterableDataset) -> Pipeline:
        """What a zero-argument factory (or a torch IterableDataset) yields; not splittable."""
        return cls(IterableSource(factory))

    # -------------------------------------------------------------------------- transforms

    def _then(self, transform: Transform) -> Pipeline:
        return type(self)(self._source, (*self._transforms, transform))

    def map(self, fn: Callable[[Any], Any], num_parallel_calls: int | None = None) -> Pipeline:
        """`fn(element)`; `num_parallel_calls` > 1 (or -1: one per core) uses an order-preserving
        thread pool."""
        return self._then(Map(fn, num_parallel_calls))

    def filter(self, predicate: Callable[[Any], Any]) -> Pipeline:
        return self._then(Filter(predicate))

    def batch(
        self,
        batch_size: int,
        drop_remainder: bool = False,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> Pipeline:
        """Collate `batch_size` consecutive elements (default: torch `default_collate`)."""
        return self._then(Batch(batch_size, drop_remainder, collate_fn))

    def unbatch(self) -> Pipeline:
        """Split each element along dim 0 (see `transforms.split_batch` for nests)."""
        return self._then(Unbatch())

    def shuffle(self, buffer_size: int, seed: int | None = None) -> Pipeline:
        """Buffered shuffle, reshuffled on each pass."""
        return self._then(Shuffle(buffer_size, seed))

    def flat_map(self, fn: Callable[[Any], Any]) -> Pipeline:
        """Concatenate the Pipelines/iterables `fn` returns (inner pipelines run locally)."""
        return self._then(FlatMap(fn))

    def interleave(
        self, fn: Callable[[Any], Any], cycle_length: int | None = None, block_length: int = 1
    ) -> Pipeline:
        return self._then(Interleave(fn, cycle_length, block_length))

    def repeat(self, count: int | None = None) -> Pipeline:
        return self._then(Repeat(count))

    def take(self, n: int) -> Pipeline:
        return self._then(Take(n))

    def skip(self, n: int) -> Pipeline:
        return self._then(Skip(n))

    def shard(self, num_shards: Any, index: Any) -> Pipeline:
        """Element k where k % num_shards == index; `SHARD_HINT` allowed for both."""
        return self._then(Shard(num_shards, index))

    def cache(self, location: str | os.PathLike[str] | None = None, *,
              max_bytes: int | None = None) -> Pipeline:
        """tf.data's `cache()`: the elements produced up to here are kept the first time and
        read back afterwards; later steps run each epoch. `location=None`: the worker's shared
        memory (locally: this process's memory); a directory: files there. Least recently used
        splits are evicted beyond `max_bytes` or on a full disk (never an error)."""
        return self._then(Cache(location, max_bytes))

    def prefetch(self, n: int) -> Pipeline:
        """Produce up to `n` elements ahead on a background thread."""
        return self._then(Prefetch(n))

    def apply(self, fn: Callable[[Pipeline], Any]) -> Any:
        """`fn(self)`, for chaining reusable pipeline functions such as `tds.distribute`."""
        check_callable("apply fn", fn)
        return fn(self)

    def with_split_size(self, split_size: int) -> Pipeline:
        """A copy whose splittable source cuts `split_size` elements per split."""
        source = self._splittable_source().with_split_size(split_size)
        return type(self)(source, self._transforms)

    # ---------------------------------------------------------------------------- queries

    @property
    def source(self) -> Source:
        return self._source

    @property
    def transforms(self) -> tuple[Transform, ...]:
        return self._transforms

    @property
    def is_splittable(self) -> bool:
        return isinstance(self._source, SplittableSource)

    @property
    def num_splits(self) -> int:
        return self._splittable_source().num_splits

    @property
    def split_size(self) -> int:
        size = self._splittable_source().split_size
        assert size is not None
        return size

    @property
    def is_file_based(self) -> bool:
        return isinstance(self._source, FilesSource)

    @property
    def files(self) -> list[str]:
        if not isinstance(self._source, FilesSource):
            raise ValueError("only a list_files or from_tar_shards source has files, not "
                             f"{self._source.describe()}")
        return list(self._source.files)

    @property
    def has_shard_hint(self) -> bool:
        return any(isinstance(t, Shard) and t.has_hint for t in self._transforms)

    def _splittable_source(self) -> SplittableSource:
        if not isinstance(self._source, SplittableSource):
            raise ValueError(f"{self._source.describe()} is not splittable")
        return self._source

    # -------------------------------------------------------------------------- execution

    def iterate(self, ctx: ExecutionContext) -> Iterator[Any]:
        """Run the chain under `ctx`; under a split provider the output is exactly the elements
        of the splits the source was given, run through the transforms."""
        if self.has_shard_hint:
            raise ValueError(
                f"{self!r} has an unresolved SHARD_HINT: it is only replaced when the pipeline "
                "runs on the service with sharding policy HINT"
            )
        return self._open(len(self._transforms), ctx)

    def _open(self, length: int, ctx: ExecutionContext) -> Iterator[Any]:
        """A pass over the source and the first `length` transforms under `ctx`."""
        if length == 0:
            return self._source.iterate(ctx)
        before = self._transforms[:length - 1]
        upstream = Upstream(self._source, functools.partial(self._open, length - 1, ctx),
                            before, functools.partial(self._open, length - 1))
        return self._transforms[length - 1].iterate(upstream, ctx)

    def __iter__(self) -> Iterator[Any]:
        return self.iterate(ExecutionContext())

    def __repr__(self) -> str:
        return ".".join(
            ["Pipeline", self._source.describe(), *(t.describe() for t in self._transforms)]
        )

"""`cache()`: the elements of the chain before it, kept the first time and read back afterwards.

An entry holds the elements one split produced (or, where no splits are handed out, one whole
pass), keyed by the fingerprint of the chain before the cache (the source with its file list or
items, every transform with its function's code) and the split index: never a job, an iteration
or a repetition, so later epochs, other jobs and other trainers over the same pipeline hit it,
and a changed pipeline computes another key. An entry is written only when its split (or pass)
ran to its natural end, and written atomically (a temporary file renamed into place), so a split
cut short (a stop, a kill, a `take` after the cache) never reads back as a whole one.

Stores: a directory (files; on a worker `location=None` is a directory in its shared memory that
the worker's executor processes share, see `ExecutionContext.cache_dir`) or this process's
memory (`location=None` run locally). Both evict the least recently used entries beyond
`max_bytes` or when the disk is full; neither ever fails the pipeline for lack of room.
"""

from __future__ import annotations

import errno
import hashlib
import io
import logging
import marshal
import os
import pickle
import threading
import time
import types
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import numpy as np
import torch

from torch_dataservice.pipeline._checks import check_optional_int
from torch_dataservice.pipeline.context import ExecutionContext
from torch_dataservice.pipeline.prefetch import Prefetch
from torch_dataservice.pipeline.sources import Source, SplittableSource
from torch_dataservice.pipeline.transforms import (
    Filter,
    FlatMap,
    Map,
    Transform,
    Unbatch,
    Upstream,
    close_iterator,
)

logger = logging.getLogger(__name__)

#: The entry of a whole pass (no split provider: local runs, OFF on one executor, FILE, DATA).
WHOLE = "all"
#: Steps that may run split by split with the same result as over the whole stream: a cache
#: under a split provider runs the chain before it once per split.
PER_ELEMENT = (Map, Filter, FlatMap, Unbatch, Prefetch)
#: Temporary files (an entry being written) left by a killed process are removed this late.
STALE_TEMP_S = 3600.0


class CacheCounts:
    """This process's cache figures since they were last taken (a worker's executors ship them
    to the worker front, which adds them up)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = [0, 0, 0]  # hits, misses, evictions

    def add(self, hits: int = 0, misses: int = 0, evictions: int = 0) -> None:
        with self._lock:
            self._counts[0] += hits
            self._counts[1] += misses
            self._counts[2] += evictions

    def take(self) -> tuple[int, int, int]:
        """(hits, misses, evictions) since the last take; zero after it."""
        with self._lock:
            hits, misses, evictions = self._counts
            self._counts = [0, 0, 0]
            return hits, misses, evictions


COUNTS = CacheCounts()
#: The directory of the worker this process is an executor of (set when the executor starts):
#: where a `CachedDataset` without a location keeps its entries.
worker_cache_dir: str | None = None


# ---------------------------------------------------------------------------- the key
def _code_digest(value: Any, digest: Any) -> None:
    """Add the code of the functions a node holds: cloudpickle pickles a function importable
    from a module by name, so its body would not show in the pickle's bytes."""
    if isinstance(value, types.FunctionType):
        digest.update(marshal.dumps(value.__code__))
    elif isinstance(value, types.MethodType):
        _code_digest(value.__func__, digest)
    elif hasattr(value, "func") and hasattr(value, "args"):  # functools.partial
        _code_digest(value.func, digest)


def fingerprint(source: Source, transforms: tuple[Transform, ...]) -> str:
    """What the chain `source` -> `transforms` is, by value: equal for equal pipelines built in
    other processes, different when a function, a file list or an argument differs."""
    digest = hashlib.sha256(cloudpickle.dumps((source, transforms)))
    for node in (source, *transforms):
        for name in getattr(node, "__dataclass_fields__", {}):
            _code_digest(getattr(node, name), digest)
    return digest.hexdigest()[:32]


# ---------------------------------------------------------------------------- encoding
class _Pickler(pickle.Pickler):
    # Tensors as numpy arrays: torch's own reduction goes through torch.save, ~30x slower.
    def reducer_override(self, obj: Any) -> Any:
        if (type(obj) is torch.Tensor and obj.device.type == "cpu" and obj.layout == torch.strided
                and not obj.requires_grad and obj.dtype not in _NOT_NUMPY):
            return torch.from_numpy, (np.ascontiguousarray(obj.numpy()),)
        return NotImplemented


_NOT_NUMPY = {torch.bfloat16, torch.complex32} | {
    getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32",
                                      "uint64") if hasattr(torch, name)}


def encode_element(element: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(element)
    return buffer.getvalue()


def decode_entry(data: bytes) -> Iterator[Any]:
    """The elements of an entry (its encoded elements one after the other)."""
    buffer = io.BytesIO(data)
    while buffer.tell() < len(data):
        yield pickle.load(buffer)


# ---------------------------------------------------------------------------- stores
class MemoryStore:
    """Entries in this process's memory, least recently used first."""

    def __init__(self) -> None:
        self._entries: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, fp: str, name: str) -> bytes | None:
        with self._lock:
            data = self._entries.get((fp, name))
            if data is not None:
                self._entries.move_to_end((fp, name))
            return data

    def put(self, fp: str, name: str, data: bytes, max_bytes: int | None) -> int:
        """Store an entry; the number of entries evicted (or 1 for this one, if too big)."""
        with self._lock:
            if max_bytes is not None and len(data) > max_bytes:
                return 1
            self._entries[(fp, name)] = data
            self._entries.move_to_end((fp, name))
            evicted = 0
            while max_bytes is not None and self.nbytes() > max_bytes:
                self._entries.popitem(last=False)
                evicted += 1
            return evicted

    def nbytes(self) -> int:
        return sum(len(data) for data in self._entries.values())


class DirectoryStore:
    """Entries as files `<directory>/<fingerprint>/<split>`, shared by every process that uses
    the directory: written as a temporary file and renamed, least recently used = oldest mtime
    (a hit touches it), evicted by whichever process needs the room."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def path(self, fp: str, name: str) -> str:
        return os.path.join(self.directory, fp, name)

    def get(self, fp: str, name: str) -> bytes | None:
        path = self.path(fp, name)
        try:
            with open(path, "rb") as file:
                data = file.read()
            os.utime(path)
        except FileNotFoundError:  # not written yet, or evicted meanwhile
            return None
        return data

    def put(self, fp: str, name: str, data: bytes, max_bytes: int | None) -> int:
        if max_bytes is not None and len(data) > max_bytes:
            return 1
        evicted = 0
        if max_bytes is not None:
            evicted += self._evict(max_bytes - len(data))
        folder = os.path.join(self.directory, fp)
        temp = os.path.join(folder, f".tmp-{name}-{os.getpid()}-{threading.get_ident()}")
        while True:
            try:
                os.makedirs(folder, exist_ok=True)
                with open(temp, "wb") as file:
                    file.write(data)
                os.replace(temp, self.path(fp, name))
                return evicted
            except OSError as error:
                _remove(temp)
                if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                # The disk (or /dev/shm) is full: make room from the oldest entry on, or
                # give this entry up; never fail the epoch.
                if not self._evict_oldest():
                    logger.warning("cache: no room for an entry of %d bytes in %s",
                                   len(data), self.directory)
                    return evicted + 1
                evicted += 1

    def entries(self) -> list[tuple[float, int, str]]:
        """(mtime, size, path) of every complete entry; stale temporary files are removed."""
        found = []
        now = time.time()
        try:
            folders = list(os.scandir(self.directory))
        except FileNotFoundError:
            return []
        for folder in folders:
            if not folder.is_dir(follow_symlinks=False):
                continue
            try:
                files = list(os.scandir(folder.path))
            except FileNotFoundError:
                continue
            for entry in files:
                try:
                    stat = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not entry.name.startswith(".tmp-"):
                    found.append((stat.st_mtime, stat.st_size, entry.path))
                elif now - stat.st_mtime > STALE_TEMP_S:
                    _remove(entry.path)
        return found

    def nbytes(self) -> int:
        return sum(size for _, size, _ in self.entries())

    def _evict(self, room: int) -> int:
        """Remove the least recently used entries until the rest fit in `room` bytes."""
        entries = sorted(self.entries())
        total = sum(size for _, size, _ in entries)
        evicted = 0
        for _, size, path in entries:
            if total <= room:
                break
            if _remove(path):
                evicted += 1
            total -= size
        return evicted

    def _evict_oldest(self) -> bool:
        for _, _, path in sorted(self.entries()):
            if _remove(path):
                return True
        return False


def _remove(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:  # another process evicted it first
        return False
    return True


# ---------------------------------------------------------------------------- the transform
class _Memo:
    """Per-object state that does not travel: the in-process store and the last fingerprint."""

    def __init__(self) -> None:
        self.store = MemoryStore()
        self.last: tuple[Source, tuple[Transform, ...], str] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__()  # type: ignore[misc]


class _OneSplit:
    """The split provider of one split's run of the chain before the cache."""

    def __init__(self, split_index: int) -> None:
        self._split: int | None = split_index

    def get_split(self, source_index: int, repetition: int) -> int | None:
        split, self._split = self._split, None
        return split


@dataclass(frozen=True, eq=False, repr=False)
class Cache(Transform):
    """tf.data's `cache()`; see the module docstring for the key, the stores and eviction."""

    location: str | None = None
    max_bytes: int | None = None
    memo: _Memo = field(default_factory=_Memo, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.location is not None:
            location = os.fspath(self.location) if isinstance(self.location, os.PathLike) \
                else self.location
            if not isinstance(location, str) or not location:
                raise ValueError(f"cache location must be None or a directory path, got "
                                 f"{self.location!r}")
            if os.path.exists(location) and not os.path.isdir(location):
                raise ValueError(f"cache location {location!r} is not a directory")
            object.__setattr__(self, "location", location)
        check_optional_int("cache max_bytes", self.max_bytes, minimum=1)

    def _fingerprint(self, upstream: Upstream) -> str:
        last = self.memo.last
        if last is not None and last[0] is upstream.source and last[1] == upstream.transforms:
            return last[2]
        fp = fingerprint(upstream.source, upstream.transforms)
        self.memo.last = (upstream.source, upstream.transforms, fp)
        return fp

    def _store(self, ctx: ExecutionContext) -> MemoryStore | DirectoryStore:
        directory = self.location if self.location is not None else ctx.cache_dir
        return self.memo.store if directory is None else DirectoryStore(directory)

    def iterate(self, upstream: Upstream, ctx: ExecutionContext) -> Iterator[Any]:
        fp = self._fingerprint(upstream)
        store = self._store(ctx)
        provider = ctx.split_provider
        if provider is None or not isinstance(upstream.source, SplittableSource):
            yield from self._entry(store, fp, WHOLE, upstream.open)
            return
        for transform in upstream.transforms:
            if not isinstance(transform, PER_ELEMENT):
                raise ValueError(
                    f"cache() after {transform.describe()}: under a split provider (sharding "
                    "DYNAMIC, or OFF over several executors) the steps before cache() run split "
                    "by split, which only per-element steps (map, filter, flat_map, unbatch, "
                    "prefetch) allow; move cache() before it")
        if ctx.cache_used is not None and isinstance(store, DirectoryStore):
            ctx.cache_used(store.directory, fp)
        repetition = ctx.next_repetition(0)
        while (split_index := provider.get_split(0, repetition)) is not None:
            ctx.current_split = (0, repetition, split_index)
            sub = ExecutionContext(split_provider=_OneSplit(split_index),
                                   cache_dir=ctx.cache_dir)
            yield from self._entry(store, fp, str(split_index),
                                   lambda sub=sub: upstream.open_under(sub))

    def _entry(self, store: MemoryStore | DirectoryStore, fp: str, name: str,
               compute: Any) -> Iterator[Any]:
        """The elements of entry `name`: read back, or computed and kept if they ran whole."""
        data = store.get(fp, name)
        if data is not None:
            COUNTS.add(hits=1)
            yield from decode_entry(data)
            return
        COUNTS.add(misses=1)
        encoded: list[bytes] | None = []
        size = 0
        iterator = compute()
        try:
            for element in iterator:
                if encoded is not None:
                    part = encode_element(element)
                    size += len(part)
                    encoded.append(part)
                    if self.max_bytes is not None and size > self.max_bytes:
                        encoded = None  # it can never fit: do not hold it
                        COUNTS.add(evictions=1)
                yield element
        finally:
            close_iterator(iterator)
        # Reached only when the chain before the cache ended by itself: the entry is whole.
        if encoded is not None:
            evicted = store.put(fp, name, b"".join(encoded), self.max_bytes)
            if evicted:
                COUNTS.add(evictions=evicted)

    def describe(self) -> str:
        args = [] if self.location is None else [repr(self.location)]
        if self.max_bytes is not None:
            args.append(f"max_bytes={self.max_bytes}")
        return f"cache({', '.join(args)})"


class CachedDataset(torch.utils.data.Dataset):
    """A map-style dataset whose `dataset[i]` (the costly load: read and decode) is kept, by
    index, the first time and read back afterwards, and whose `transform` (random crops, flips)
    runs on every access: `cache()` for `tds.DataLoader`, whose epochs visit indices in another
    order (so a split-keyed cache would miss). On a worker, `location=None` keeps the entries in
    the worker's shared memory, shared by its executor processes; elsewhere in this process's
    memory. The key is the fingerprint of `dataset` (its class's code and its state) and the
    index."""

    def __init__(self, dataset: Any, transform: Any = None, *, location: Any = None,
                 max_bytes: int | None = None) -> None:
        if not hasattr(dataset, "__getitem__"):
            raise ValueError(f"CachedDataset needs a map-style dataset, got {dataset!r}")
        if transform is not None and not callable(transform):
            raise ValueError(f"CachedDataset transform must be callable, got {transform!r}")
        self.dataset = dataset
        self.transform = transform
        self._cache = Cache(location, max_bytes)  # validates both; holds the memory store
        self._fingerprint: str | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        if self._fingerprint is None:
            digest = hashlib.sha256(cloudpickle.dumps(self.dataset))
            for cls in type(self.dataset).__mro__:
                for value in vars(cls).values():
                    _code_digest(value, digest)
            self._fingerprint = digest.hexdigest()[:32]
        directory = self._cache.location or worker_cache_dir
        store = self._cache.memo.store if directory is None else DirectoryStore(directory)
        data = store.get(self._fingerprint, str(index))
        if data is not None:
            COUNTS.add(hits=1)
            (element,) = decode_entry(data)
        else:
            COUNTS.add(misses=1)
            element = self.dataset[index]
            evicted = store.put(self._fingerprint, str(index), encode_element(element),
                                self._cache.max_bytes)
            if evicted:
                COUNTS.add(evictions=evicted)
        return element if self.transform is None else self.transform(element)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_fingerprint": None}

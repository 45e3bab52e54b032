"""The worker front's view of `cache()` (pipeline/cache.py): its store, figures and index.

The worker owns one directory in shared memory (/dev/shm where there is one) for `cache()`
without a location: its executor processes are separate processes, and files there are memory
they all read and write, and that outlives any one of them (an executor that dies and restarts
keeps the worker's cache). It counts against /dev/shm's size. The directory is removed when
the worker stops; one left by a worker that was killed is removed by the next worker on the
host that finds its process gone.

Executors report their figures and, per dataset, where its split entries are (CacheUsed), so
the front answers `cached_splits()`: for each dataset, the splits whose entries are complete
here, which the dispatcher's split affinity uses to hand a split to the worker holding it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping, Sequence

from torch_dataservice.pipeline.cache import DirectoryStore
from torch_dataservice.worker.messages import CacheCounts, CacheUsed

logger = logging.getLogger(__name__)

PREFIX = "tds-cache-"


def _shared_memory_root() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_orphans(root: str) -> None:
    """Remove cache directories of workers whose process is gone (killed, not stopped)."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        pid = name[len(PREFIX):].split("-", 1)[0]
        if name.startswith(PREFIX) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


class WorkerCache:
    """The worker's cache directory, its figures, and which splits it holds per dataset."""

    def __init__(self, root: str | None = None) -> None:
        root = root or _shared_memory_root()
        _remove_orphans(root)
        self.directory = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root)
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0
        self._used: dict[str, set[tuple[str, str]]] = {}  # dataset -> {(directory, fp)}

    def on_report(self, report: CacheCounts | CacheUsed) -> None:
        with self._lock:
            match report:
                case CacheCounts(hits, misses, evictions):
                    self.hits += hits
                    self.misses += misses
                    self.evictions += evictions
                case CacheUsed(dataset_id, directory, fingerprint):
                    self._used.setdefault(dataset_id, set()).add((directory, fingerprint))

    def counts(self) -> tuple[int, int, int]:
        """(hits, misses, evictions) so far."""
        with self._lock:
            return self.hits, self.misses, self.evictions

    def nbytes(self) -> int:
        """Bytes of the entries in the worker's directory and in the directories its datasets
        named (`cache(location)`)."""
        with self._lock:
            directories = {self.directory} | {d for used in self._used.values() for d, _ in used}
        return sum(DirectoryStore(directory).nbytes() for directory in directories)

    def cached_splits(self) -> Mapping[str, Sequence[int]]:
        """For each dataset whose tasks ran here with a `cache()` read split by split (DYNAMIC
        or OFF), the sorted indices of the splits whose entries are complete in the cache."""
        with self._lock:
            used = {dataset: sorted(places) for dataset, places in self._used.items()}
        found: dict[str, list[int]] = {}
        for dataset_id, places in used.items():
            splits: set[int] = set()
            for directory, fingerprint in places:
                try:
                    names = os.listdir(os.path.join(directory, fingerprint))
                except OSError:  # none written yet, or evicted
                    continue
                splits.update(int(name) for name in names if name.isdigit())
            found[dataset_id] = sorted(splits)
        return found

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)

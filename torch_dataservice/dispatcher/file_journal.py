"""FileJournal: the fault-tolerant dispatcher's write-ahead log of `Update` records.

Layout in `<work_dir>/dispatcher_journal/`:

    snapshot_<g>   one record: the whole state when log generation g started (optional)
    log_<g>        the updates applied after that, in order

The snapshot record is an `Update` of kind `snapshot` whose bytes are a `DispatcherSnapshot`
protobuf (dispatcher/snapshot.py, protos/torch_dataservice/v1/snapshot.proto), not a pickle: any
version that knows its schema version reads it, and reading it runs no code. Applying it
replaces the whole state, so replay yields it first, like any other update.

Replay reads the newest snapshot, then every log from its generation on, in order. Each
dispatcher incarnation appends to a new log (one past the highest existing file), so a torn
tail written by a crashed incarnation is never appended to. Compaction, when the current log
holds more than `compact_every` records, writes `snapshot_<g+1>` (temp file, fsync, rename,
fsync the directory), starts `log_<g+1>` and only then deletes the older files; a crash at
any point leaves either the old files or the new snapshot complete.

Record framing: 4-byte little-endian payload length, 4-byte CRC32 of the payload, payload (a
serialized `Update`, in snapshot files too). A short or mismatching record ends that file:
replay logs a warning and goes on with the next file. Only a record being written when the
process died can be torn, and its RPC never replied, so dropping it loses nothing that anyone
was told.

Durability is group commit: `append` writes the record (no fsync) under the dispatcher's
lock, in the order updates are applied; `sync` (called by every RPC before it replies, with
the lock released) fsyncs everything appended so far, and concurrent callers share one fsync.
A reply therefore never depends on an update that is not on disk, while a slow fsync never
holds the dispatcher's lock and is paid once per batch of concurrent requests, not per split.
"""

from __future__ import annotations

import logging
import os
import re
import struct
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch_dataservice.proto import dispatcher_pb2

logger = logging.getLogger(__name__)

Update = dispatcher_pb2.Update
JOURNAL_DIR = "dispatcher_journal"
HEADER = struct.Struct("<II")  # payload length, crc32(payload)
DEFAULT_COMPACT_EVERY = 10_000
_FILE_RE = re.compile(r"^(log|snapshot)_(\d+)$")


def encode_record(payload: bytes) -> bytes:
    return HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def read_records(path: Path) -> Iterator[bytes]:
    """Payloads of the intact records of `path`; stops (with a warning) at the first bad one."""
    data = path.read_bytes()
    position = 0
    while position < len(data):
        if position + HEADER.size > len(data):
            logger.warning("%s: torn record header at byte %d (%d bytes dropped)",
                           path, position, len(data) - position)
            return
        length, crc = HEADER.unpack_from(data, position)
        start = position + HEADER.size
        payload = data[start:start + length]
        if len(payload) < length:
            logger.warning("%s: torn record at byte %d (%d of %d bytes; dropped)",
                           path, position, len(payload), length)
            return
        if zlib.crc32(payload) != crc:
            logger.warning("%s: record at byte %d fails its checksum; it and the %d bytes "
                           "after it are dropped", path, position, len(data) - start - length)
            return
        yield payload
        position = start + length


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileJournal:
    """The journal of one dispatcher incarnation in `work_dir` (see the module docstring)."""

    def __init__(self, work_dir: str | os.PathLike[str],
                 compact_every: int = DEFAULT_COMPACT_EVERY) -> None:
        if compact_every < 1:
            raise ValueError(f"compact_every must be >= 1, got {compact_every!r}")
        self._dir = Path(work_dir) / JOURNAL_DIR
        self._dir.mkdir(parents=True, exist_ok=True)
        self._compact_every = compact_every
        self._lock = threading.Lock()  # the file and the write position
        self._sync_lock = threading.Lock()  # one fsync at a time; waiters share its result
        for leftover in self._dir.glob("*.tmp"):  # a compaction that did not finish
            leftover.unlink()
        self._previous = self._files()
        generations = [g for _, g in self._previous]
        self._generation = max(generations, default=-1) + 1
        self._fd = self._open_log(self._generation)  # fail fast if the dir is not writable
        self._records = 0
        self._written = 0  # bytes appended to the current log
        self._synced = 0  # bytes of it known to be on disk

    @property
    def directory(self) -> Path:
        return self._dir

    def _files(self) -> list[tuple[str, int]]:
        found = []
        for entry in self._dir.iterdir():
            match = _FILE_RE.match(entry.name)
            if match:
                found.append((match.group(1), int(match.group(2))))
        return found

    def _path(self, kind: str, generation: int) -> Path:
        return self._dir / f"{kind}_{generation}"

    def _open_log(self, generation: int) -> int:
        fd = os.open(self._path("log", generation), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                     0o600)
        _fsync_dir(self._dir)
        return fd

    # ------------------------------------------------------------------ reading
    def replay(self) -> Iterator[Update]:
        """Every update of the previous incarnations: the newest snapshot, then the logs."""
        snapshots = [g for kind, g in self._previous if kind == "snapshot"]
        start = max(snapshots, default=0)
        if snapshots:
            records = list(read_records(self._path("snapshot", start)))
            if len(records) != 1:
                raise RuntimeError(f"journal snapshot {self._path('snapshot', start)} is "
                                   "damaged; it was written atomically, so the disk is at fault")
            snapshot = Update.FromString(records[0])
            if snapshot.WhichOneof("kind") != "snapshot":
                raise RuntimeError(f"journal snapshot {self._path('snapshot', start)} holds a "
                                   f"{snapshot.WhichOneof('kind')!r} update, not a snapshot")
            yield snapshot
        logs = sorted(g for kind, g in self._previous if kind == "log" and g >= start)
        for generation in logs:
            for payload in read_records(self._path("log", generation)):
                yield Update.FromString(payload)

    # ------------------------------------------------------------------ writing
    def append(self, update: Update) -> None:
        """Write `update` at the end of the log; durable after the next `sync()`."""
        record = encode_record(update.SerializeToString())
        with self._lock:
            os.write(self._fd, record)
            self._written += len(record)
            self._records += 1

    def sync(self) -> None:
        """Return once everything appended before this call is on disk (group commit)."""
        with self._lock:
            generation, target = self._generation, self._written
        if self._synced >= target:
            return
        with self._sync_lock:
            with self._lock:
                if generation != self._generation or self._fd < 0:
                    return  # compacted (the snapshot is durable) or closed (fsynced)
                fd, written = self._fd, self._written
            if self._synced >= target:
                return  # the fsync we waited for covered us
            os.fsync(fd)
            self._synced = max(self._synced, written)

    def maybe_compact(self, state: Any) -> bool:
        """Replace everything so far by a snapshot of `state` when the log has grown long.

        Called right after an update is applied, under the dispatcher's lock, so `state`
        reflects exactly the records appended so far.
        """
        with self._lock:
            if self._records < self._compact_every:
                return False
        self.compact(state)
        return True

    def compact(self, state: Any) -> None:
        snapshot = state.snapshot().SerializeToString()
        with self._sync_lock, self._lock:
            generation = self._generation + 1
            final = self._path("snapshot", generation)
            temp = final.with_name(final.name + ".tmp")
            with open(temp, "wb") as f:
                f.write(encode_record(snapshot))
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, final)
            _fsync_dir(self._dir)
            old_fd = self._fd
            self._fd = self._open_log(generation)
            os.close(old_fd)
            self._generation = generation
            self._records = self._written = self._synced = 0
            for kind, g in self._files():
                if g < generation:
                    self._path(kind, g).unlink(missing_ok=True)
            self._previous = []
        logger.info("journal compacted into %s (%d bytes)", final, len(snapshot))

    def close(self) -> None:
        with self._sync_lock, self._lock:
            if self._fd < 0:
                return
            fd, self._fd = self._fd, -1
            os.fsync(fd)
            os.close(fd)

"""Tar shards in the WebDataset layout as a splittable source.

A shard is a tar file whose consecutive members sharing a key make one sample:
`train/0001.jpg`, `train/0001.cls` -> `{"__key__": "train/0001", "__url__": shard, "jpg": ...,
"cls": ...}` (the key is the member name up to the first dot of its base name, as WebDataset
splits it). A shard is one item of the source: a split under DYNAMIC, a file under FILE
sharding, and a sample's position in its shard is its offset in the split.

Members are read from a stream (a store is fetched a block at a time) by a reader of our own
rather than `tarfile`'s stream mode: that one ends quietly at a truncated or damaged header,
which would make a short epoch. Here the archive must end with its end-of-archive block, and
anything else is a `tarfile.ReadError` naming the shard and the byte offset.
"""

from __future__ import annotations

import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from torch_dataservice.pipeline.sources import FilesSource
from torch_dataservice.pipeline.storage import open_stream

BLOCK = 512
_END_OF_ARCHIVE = bytes(BLOCK)
# WebDataset's split of a member name into key and extension (webdataset.tariterators).
_KEY_AND_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


@dataclass(frozen=True, eq=False, repr=False)
class TarShardsSource(FilesSource):
    """Samples of the shards `files`, shard after shard."""

    one_element_per_item = False

    def elements(self, start: int, stop: int) -> Iterator[dict[str, Any]]:
        for url in self.files[start:stop]:
            yield from read_shard(url)

    def describe(self) -> str:
        return f"from_tar_shards(<{len(self.files)} shards>)"


def read_shard(url: str) -> Iterator[dict[str, Any]]:
    """The samples of one shard, in order, streamed."""
    with open_stream(url) as stream:
        sample: dict[str, Any] | None = None
        for offset, name, data in _members(stream, url):
            match = _KEY_AND_EXT.match(name)
            if match is None:  # no extension: not part of a sample (WebDataset skips it too)
                continue
            key, ext = match.groups()
            if sample is not None and sample["__key__"] != key:
                yield sample
                sample = None
            if sample is None:
                sample = {"__key__": key, "__url__": url}
            elif ext in sample:
                raise tarfile.ReadError(
                    f"tar shard {url!r}: member {name!r} at byte offset {offset} repeats "
                    f"extension {ext!r} of sample {key!r}")
            sample[ext] = data
        if sample is not None:
            yield sample


def _members(stream: IO[bytes], url: str) -> Iterator[tuple[int, str, bytes]]:
    """(header offset, name, data) of each regular file in the archive."""
    offset = 0
    extended: dict[str, str] = {}  # from a pax or GNU long-name header, for the next member
    while True:
        header = _read(stream, BLOCK, url, offset, "a member header")
        if header == _END_OF_ARCHIVE:
            return
        try:
            info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
            size = int(extended.get("size", info.size))
        except (tarfile.HeaderError, ValueError) as error:
            raise tarfile.ReadError(
                f"tar shard {url!r}: damaged member header at byte offset {offset} ({error})"
            ) from None
        name = extended.get("path", info.name)
        what = f"member {name!r} (header at byte offset {offset})"
        data = _read(stream, size, url, offset + BLOCK, what)
        padded = size + -size % BLOCK
        _read(stream, padded - size, url, offset + BLOCK + size, what)
        if info.type == tarfile.XHDTYPE:
            extended = _pax_records(data, url, offset)
        elif info.type == tarfile.GNUTYPE_LONGNAME:
            extended = {"path": data.rstrip(b"\0").decode("utf-8", "surrogateescape")}
        else:
            extended = {}
            if info.isreg():
                yield offset, name, data
        offset += BLOCK + padded


def _read(stream: IO[bytes], size: int, url: str, at: int, what: str) -> bytes:
    """Exactly `size` bytes from byte offset `at`; a shard that ends first, or a read that
    fails, names the shard and the offset."""
    chunks = []
    got = 0
    try:
        while got < size:
            chunk = stream.read(size - got)
            if not chunk:
                raise tarfile.ReadError(
                    f"tar shard {url!r} is truncated at byte offset {at + got}, inside {what} "
                    "(a tar archive ends with a block of zeros)")
            chunks.append(chunk)
            got += len(chunk)
    except OSError as error:
        raise OSError(f"tar shard {url!r}: reading {what} at byte offset {at + got} failed: "
                      f"{error}") from error
    return b"".join(chunks)


def _pax_records(data: bytes, url: str, offset: int) -> dict[str, str]:
    """`LENGTH KEY=VALUE\\n` records of a pax extended header."""
    records = {}
    position = 0
    try:
        while position < len(data) and data[position]:
            space = data.index(b" ", position)
            length = int(data[position:space])
            if length <= space - position:  # would not move on: a loop, not a record
                raise ValueError(f"record length {length}")
            key, _, value = data[space + 1:position + length - 1].partition(b"=")
            records[key.decode()] = value.decode("utf-8", "surrogateescape")
            position += length
    except (ValueError, UnicodeDecodeError) as error:
        raise tarfile.ReadError(
            f"tar shard {url!r}: damaged pax header at byte offset {offset} ({error})") from None
    return records

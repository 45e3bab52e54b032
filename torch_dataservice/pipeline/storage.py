"""Where data lives: local paths, and fsspec URLs (`s3://`, `gs://`, `hf://`, `memory://`,
`file://`, ...) read and listed through one filesystem object per protocol in each process,
so that an executor keeps its connections to a store across elements.

A store's settings and credentials come from its usual environment (for S3: `AWS_*` variables
or `~/.aws`; fsspec's `FSSPEC_<PROTOCOL>_<OPTION>` variables), on every host that reads.
fsspec is imported on the first URL (it costs 0.1-0.2 s): local paths never need it.
"""

from __future__ import annotations

import glob as local_glob
import os
import threading
from typing import IO, Any

#: A shard streamed from a store is fetched this many bytes ahead, never whole before its first
#: sample.
STREAM_BLOCK_BYTES = 8 << 20

_filesystems: dict[str, Any] = {}
_lock = threading.Lock()


def _forget_in_child() -> None:
    """A forked child must not reuse its parent's connections (fsspec resets its own loop then
    too), nor wait on a lock a parent's thread held at the fork."""
    global _lock
    _filesystems.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def protocol_of(path_or_url: str) -> str | None:
    """The URL's protocol (`"s3"`, `"file"`, ...), or None for a local path."""
    if "://" not in path_or_url:
        return None
    import fsspec.core

    protocol, _ = fsspec.core.split_protocol(path_or_url)
    return protocol


def filesystem(protocol: str, url: str) -> Any:
    """This process's filesystem object for `protocol`; `url` names the error if its
    implementation is missing."""
    with _lock:
        fs = _filesystems.get(protocol)
        if fs is None:
            fs = _filesystems[protocol] = _create(protocol, url)
        return fs


def _create(protocol: str, url: str) -> Any:
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as error:
        raise ValueError(f"{url!r}: {_install_hint(protocol, error)}") from None
    except ValueError:
        raise ValueError(f"{url!r}: fsspec knows no protocol {protocol!r}") from None
    return fsspec.filesystem(protocol)


def _install_hint(protocol: str, error: ImportError) -> str:
    from fsspec.registry import known_implementations

    implementation = known_implementations.get(protocol, {}).get("class", "")
    package = implementation.split(".")[0]
    if not package or package == "fsspec":  # built in, but needs a package of its own
        return f"the {protocol}:// protocol is not available: {error}"
    return (f"the {protocol}:// protocol needs the package {package!r}: pip install {package} "
            f"({error})")


def _split(path_or_url: str | os.PathLike[str]) -> tuple[Any, str]:
    """(filesystem object or None for a local path, the path within it)."""
    path = os.fspath(path_or_url) if isinstance(path_or_url, os.PathLike) else path_or_url
    if not isinstance(path, str):
        raise ValueError(f"expected a path or URL string, got {path_or_url!r}")
    protocol = protocol_of(path)
    if protocol is None:
        return None, path
    fs = filesystem(protocol, path)
    return fs, fs._strip_protocol(path)


def read_bytes(path_or_url: str | os.PathLike[str]) -> bytes:
    """The whole content of a local path or an fsspec URL."""
    fs, path = _split(path_or_url)
    if fs is None:
        with open(path, "rb") as f:
            return f.read()
    return fs.cat_file(path)


def open_stream(path_or_url: str) -> IO[bytes]:
    """A file to read once from start to end: from a store, STREAM_BLOCK_BYTES at a time."""
    fs, path = _split(path_or_url)
    if fs is None:
        return open(path, "rb")
    return fs.open(path, "rb", block_size=STREAM_BLOCK_BYTES, cache_type="readahead")


def glob(pattern: str) -> list[str]:
    """Local paths, or URLs, matching a glob pattern. A store is listed now, not answered from
    an earlier listing of this process; an error names the pattern."""
    fs, path = _split(pattern)
    if fs is None:
        return local_glob.glob(path)
    fs.invalidate_cache()
    try:
        matches = fs.glob(path)
    except Exception as error:  # the store's own types: botocore, google.auth, requests, ...
        raise OSError(
            f"cannot list {pattern!r}: {type(error).__name__}: {error} (check the address and "
            f"credentials of the {protocol_of(pattern)}:// store in this process's environment)"
        ) from error
    return [fs.unstrip_protocol(match) for match in matches]

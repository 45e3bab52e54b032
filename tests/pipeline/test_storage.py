"""Paths and fsspec URLs in list_files and read_bytes, on stores that need no server
(memory://, file://); the S3 server is in tests/integration/test_object_store.py."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator

import cloudpickle
import pytest

import torch_dataservice as tds
from tests.conftest import subprocess_env
from torch_dataservice.pipeline import storage

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def memory_root() -> Iterator[str]:
    """A fresh directory of this process's memory:// store, removed afterwards."""
    import fsspec

    root = f"/tds-test-{uuid.uuid4().hex}"
    yield root
    memory = fsspec.filesystem("memory")
    if memory.exists(root):
        memory.rm(root, recursive=True)


def put(url: str, data: bytes) -> None:
    import fsspec

    fsspec.filesystem("memory").pipe(fsspec.core.strip_protocol(url), data)


def test_list_files_lists_a_store_once_and_yields_urls(memory_root: str) -> None:
    for name in ["b.txt", "a.txt", "c.bin", "sub/d.txt"]:
        put(f"memory://{memory_root}/{name}", name.encode())
    pipeline = tds.Pipeline.list_files(f"memory://{memory_root}/*.txt")
    expected = [f"memory://{memory_root}/a.txt", f"memory://{memory_root}/b.txt"]
    assert list(pipeline) == expected and pipeline.files == expected
    assert [tds.read_bytes(url) for url in pipeline] == [b"a.txt", b"b.txt"]
    # The list, not the pattern, travels: a file added later is in no copy of the pipeline.
    put(f"memory://{memory_root}/e.txt", b"e")
    shipped = cloudpickle.loads(cloudpickle.dumps(pipeline))
    assert list(shipped) == expected and list(pipeline) == expected
    assert len(tds.Pipeline.list_files(f"memory://{memory_root}/*.txt").files) == 3


def test_file_urls_stay_urls_and_local_paths_stay_paths(tmp_path) -> None:
    for name in ["a.txt", "b.txt"]:
        (tmp_path / name).write_text(name)
    urls = list(tds.Pipeline.list_files(f"file://{tmp_path}/*.txt"))
    assert urls == [f"file://{tmp_path}/a.txt", f"file://{tmp_path}/b.txt"]
    paths = list(tds.Pipeline.list_files(str(tmp_path / "*.txt")))
    assert paths == [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    assert [tds.read_bytes(u) for u in urls] == [tds.read_bytes(p) for p in paths] == [
        b"a.txt", b"b.txt"]
    assert tds.read_bytes(tmp_path / "a.txt") == b"a.txt"  # os.PathLike too


@pytest.mark.integration
def test_one_filesystem_object_per_protocol_and_none_inherited_by_a_child(
        memory_root: str) -> None:
    put(f"memory://{memory_root}/a", b"a")
    tds.read_bytes(f"memory://{memory_root}/a")
    first = storage.filesystem("memory", "memory://")
    tds.read_bytes(f"memory://{memory_root}/a")
    assert storage.filesystem("memory", "memory://") is first
    # Forked in a fresh interpreter: this one may run gRPC threads, which a fork must avoid.
    code = ("import os\n"
            "from torch_dataservice.pipeline import storage\n"
            "storage.filesystem('memory', 'memory://')\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    os._exit(len(storage._filesystems))\n"
            "print(os.waitpid(pid, 0)[1] >> 8, len(storage._filesystems))\n")
    run = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True,
                         text=True, timeout=60)
    assert run.stdout.split() == ["0", "1"], run.stderr  # the child's cache is empty


@pytest.mark.parametrize(("url", "package"), [
    ("gs://bucket/train/*.tar", "gcsfs"),
    ("hf://datasets/someone/data/*.tar", "huggingface_hub"),
])
def test_a_missing_implementation_names_the_package_to_install(url: str, package: str) -> None:
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    with pytest.raises(ValueError, match=f"{re.escape(url)}.*pip install {package}"):
        tds.Pipeline.list_files(url)
    with pytest.raises(ValueError, match=f"pip install {package}"):
        tds.read_bytes(url.replace("*", "x"))
    with pytest.raises(ValueError, match=f"pip install {package}"):
        tds.Pipeline.from_tar_shards(url)


def test_bad_urls_name_the_value(memory_root: str) -> None:
    with pytest.raises(ValueError, match="'nosuch://b/x'.*no protocol 'nosuch'"):
        tds.read_bytes("nosuch://b/x")
    missing = f"memory://{memory_root}/*.tar"
    with pytest.raises(ValueError, match=f"no files match pattern {re.escape(repr(missing))}"):
        tds.Pipeline.list_files(missing)
    with pytest.raises(ValueError, match="from_tar_shards: no files match"):
        tds.Pipeline.from_tar_shards(missing)
    with pytest.raises(ValueError, match="path or URL.*3"):
        tds.read_bytes(3)  # type: ignore[arg-type]

"""Pipeline.from_tar_shards: WebDataset samples, a shard per split or per file, streamed, and
a truncated or damaged shard is an error naming it and the byte offset."""

from __future__ import annotations

import itertools
import json
import os
import re
import tarfile
import threading
from pathlib import Path

import pytest

import torch_dataservice as tds
from tests.pipeline.tar_support import numbered_samples, shard_bytes
from torch_dataservice.pipeline import ExecutionContext
from torch_dataservice.pipeline.sharding import shard_files
from torch_dataservice.torch import iterable_state

pytestmark = pytest.mark.timeout(60)


def write_shards(directory: Path, counts: list[int]) -> list[str]:
    paths = []
    for shard, count in enumerate(counts):
        path = directory / f"shard-{shard:03d}.tar"
        path.write_bytes(shard_bytes(numbered_samples(shard, count)))
        paths.append(str(path))
    return paths


def keys(samples) -> list[str]:
    return [sample["__key__"] for sample in samples]


def test_members_sharing_a_key_make_one_sample(tmp_path: Path) -> None:
    path = tmp_path / "a.tar"
    path.write_bytes(shard_bytes({
        "train/0001": {"jpg": b"J1", "cls": b"3", "seg.png": b"P1"},
        "train/0002": {"jpg": b"J2", "cls": b"4"},
    }))
    samples = list(tds.Pipeline.from_tar_shards(str(path)))
    url = str(path)
    assert samples == [
        {"__key__": "train/0001", "__url__": url, "jpg": b"J1", "cls": b"3", "seg.png": b"P1"},
        {"__key__": "train/0002", "__url__": url, "jpg": b"J2", "cls": b"4"},
    ]


@pytest.mark.parametrize("tar_format", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT,
                                        tarfile.USTAR_FORMAT])
def test_long_member_names(tmp_path: Path, tar_format: int) -> None:
    key = "d" * 60 + "/" + "k" * 80  # > 100 bytes: pax, GNU long-name or ustar prefix
    (tmp_path / "a.tar").write_bytes(shard_bytes({key: {"jpg": b"x" * 700, "cls": b"1"},
                                                  "short": {"cls": b"2"}}, tar_format))
    samples = list(tds.Pipeline.from_tar_shards(str(tmp_path / "a.tar")))
    assert keys(samples) == [key, "short"] and samples[0]["jpg"] == b"x" * 700


def test_shards_follow_each_other_sorted_or_shuffled_by_seed(tmp_path: Path) -> None:
    paths = write_shards(tmp_path, [3, 0, 2])
    pipeline = tds.Pipeline.from_tar_shards(str(tmp_path / "*.tar"))
    assert pipeline.files == paths and repr(pipeline) == "Pipeline.from_tar_shards(<3 shards>)"
    assert keys(pipeline) == [*numbered_samples(0, 3), *numbered_samples(2, 2)]
    assert {s["__url__"] for s in pipeline} == {paths[0], paths[2]}
    shuffled = tds.Pipeline.from_tar_shards(paths, shuffle=True, seed=5).files
    assert shuffled == tds.Pipeline.from_tar_shards(paths, shuffle=True, seed=5).files
    assert sorted(shuffled) == paths


class Splits:
    """A split provider handing out fixed split indices (repetition 0 only)."""

    def __init__(self, indices: list[int]) -> None:
        self.indices = list(indices)

    def get_split(self, source_index: int, repetition: int) -> int | None:
        return self.indices.pop(0) if self.indices and repetition == 0 else None


def test_a_shard_is_a_split_and_a_file(tmp_path: Path) -> None:
    write_shards(tmp_path, [2, 3, 1, 2])
    pipeline = tds.Pipeline.from_tar_shards(str(tmp_path / "*.tar"))
    assert pipeline.is_splittable and pipeline.num_splits == 4 and pipeline.split_size == 1
    assert list(pipeline.map(lambda s: s["__key__"]).iterate(
        ExecutionContext(split_provider=Splits([2, 0])))) == [
            *numbered_samples(2, 1), *numbered_samples(0, 2)]
    assert pipeline.is_file_based
    second = shard_files(pipeline, 2, 1)
    assert second.files == pipeline.files[1::2]
    assert keys(second) == [*numbered_samples(1, 3), *numbered_samples(3, 2)]
    # A tds.DataLoader's batch size does not make a split of many shards.
    assert iterable_state.aligned(pipeline, 64).split_size == 1


def damaged(data: bytes, kind: str) -> tuple[bytes, int]:
    """`data` (two 1000-byte members per sample) damaged from the header of the 4th member (the
    2nd of sample 1: sample 0 is complete before it); the byte offset the error must name."""
    header = 3 * (512 + 1024)
    if kind == "cut in member data":
        return data[:header + 512 + 300], header + 512 + 300
    if kind == "cut in a header":
        return data[:header + 100], header + 100
    if kind == "cut between members":
        return data[:header], header
    assert kind == "damaged header"
    broken = bytearray(data)
    broken[header + 3] ^= 0xFF  # in the name: the checksum no longer matches
    return bytes(broken), header


@pytest.mark.parametrize("kind", ["cut in member data", "cut in a header",
                                  "cut between members", "damaged header"])
def test_a_truncated_or_damaged_shard_is_an_error_naming_it_and_the_offset(
        tmp_path: Path, kind: str) -> None:
    samples = {f"k{i}": {"jpg": bytes(1000), "cls": bytes(1000)} for i in range(3)}
    data, offset = damaged(shard_bytes(samples, tarfile.USTAR_FORMAT), kind)
    path = tmp_path / "bad.tar"
    path.write_bytes(data)
    iterator = iter(tds.Pipeline.from_tar_shards(str(path)))
    assert next(iterator)["__key__"] == "k0"  # what came before the damage
    with pytest.raises(tarfile.ReadError, match=rf"{re.escape(repr(str(path)))}.*byte offset "
                                                rf"{offset}\b"):
        next(iterator)


def test_a_shard_streams(tmp_path: Path) -> None:
    """The first sample arrives while the rest of the shard is not yet written (a FIFO): the
    shard is never read whole first."""
    samples = numbered_samples(0, 3, image_bytes=70_000)
    data = shard_bytes(samples)
    # Sample 0 (a header and 70,144 padded bytes of jpg, a header and a block of cls), and
    # sample 1's jpg, which tells the reader that sample 0 is complete.
    first_two = 2 * (512 + 70_144) + 2 * 512
    fifo = tmp_path / "shard.tar"
    os.mkfifo(fifo)
    go_on = threading.Event()

    def write() -> None:
        with open(fifo, "wb") as f:
            f.write(data[:first_two])
            f.flush()
            go_on.wait(30)
            f.write(data[first_two:])

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    iterator = iter(tds.Pipeline.from_tar_shards(str(fifo)))
    first = next(iterator)
    assert not go_on.is_set() and first["__key__"] == "s000/00000"
    go_on.set()
    assert keys(iterator) == list(samples)[1:]
    writer.join(10)


@pytest.mark.integration
def test_a_dynamic_epoch_reads_every_sample_once(tmp_path: Path, cluster_factory) -> None:
    counts = [5, 1, 7, 3, 4, 6]
    write_shards(tmp_path, counts)
    cluster = cluster_factory(2)
    pipeline = tds.Pipeline.from_tar_shards(str(tmp_path / "*.tar")).map(
        lambda s: (s["__key__"], s["cls"]))
    distributed = pipeline.apply(tds.distribute(tds.ShardingPolicy.DYNAMIC, cluster.target))
    got = list(distributed)
    expected = [(key, fields["cls"]) for shard, count in enumerate(counts)
                for key, fields in numbered_samples(shard, count).items()]
    assert sorted(got) == sorted(expected) and len(got) == len(expected)


@pytest.mark.integration
def test_a_damaged_shard_fails_the_read_through_the_service(
        tmp_path: Path, cluster_factory) -> None:
    write_shards(tmp_path, [4, 4])
    good = (tmp_path / "shard-001.tar").read_bytes()
    (tmp_path / "shard-001.tar").write_bytes(good[:3000])
    cluster = cluster_factory(1)
    distributed = tds.Pipeline.from_tar_shards(str(tmp_path / "*.tar")).apply(
        tds.distribute(tds.ShardingPolicy.DYNAMIC, cluster.target))
    with pytest.raises(tds.RemoteError, match=r"shard-001\.tar.*truncated at byte offset 3000"):
        list(distributed)


@pytest.mark.integration
def test_a_loader_resumes_a_tar_shard_epoch_with_exactly_the_rest(
        tmp_path: Path, cluster_factory) -> None:
    """Samples, each tagged with its shard and its position in it. (Batches of the loader's
    own span shards, which makes its state approximate: see torch/iterable_state.py.)"""
    counts = [9, 4, 11, 6, 7]
    write_shards(tmp_path, counts)
    cluster = cluster_factory(1)
    pipeline = tds.Pipeline.from_tar_shards(str(tmp_path / "*.tar")).map(
        lambda s: int(s["__key__"][1:4]) * 1000 + int(s["cls"]))
    everything = sorted(shard * 1000 + i for shard, count in enumerate(counts)
                        for i in range(count))
    loader = tds.DataLoader(pipeline, batch_size=None, service=cluster.target)
    it = iter(loader)
    before = [int(x) for x in itertools.islice(it, 15)]  # in the middle of a shard
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["in_progress"] and state["consumed"]
    del it
    resumed = tds.DataLoader(pipeline, batch_size=None, service=cluster.target)
    resumed.load_state_dict(state)
    after = [int(x) for x in resumed]
    assert sorted(before + after) == everything and len(before + after) == len(everything)

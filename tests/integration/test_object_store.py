"""Pipelines over a real S3-compatible server (moto's, as its own process on loopback, see
object_store.py), read by CLI workers and a trainer process: an epoch of tar shards exactly
once through a worker SIGKILLed mid-shard; one listing per registration whatever the number
of workers and executors, counted at the server; shards streamed; and credentials missing or
wrong failing where the pipeline is registered, naming the URL."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, ProcessCluster, wait_until
from tests.integration.object_store import (
    BIG_SAMPLE_BYTES,
    BUCKET,
    FILES,
    SHARDS,
    S3Server,
    assert_one_epoch,
    big_shard,
    expected_samples,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("s3"))
    yield server
    server.stop()


def start_reader(cluster: ProcessCluster, s3: S3Server, source: str, url: str, out: Path,
                 max_rate: float = 0.0) -> subprocess.Popen[str]:
    assert cluster.dispatcher is not None
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.s3_reader", cluster.dispatcher.address,
         source, url, str(out), str(max_rate)],
        env=s3.env(), cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True)


def finish(reader: subprocess.Popen[str], out: Path) -> list[str]:
    """The reader's lines once it exited cleanly, without the final "done"."""
    output, _ = reader.communicate(timeout=150)
    lines = out.read_text().splitlines()
    assert reader.returncode == 0 and lines[-1:] == ["done"], output
    return lines[:-1]


def lines_in(out: Path) -> int:
    return out.read_text().count("\n") if out.exists() else 0


@pytest.mark.slow
def test_an_epoch_is_read_exactly_once_through_a_worker_killed_mid_shard(
        process_cluster: ProcessCluster, s3: S3Server, tmp_path: Path) -> None:
    process_cluster.env = s3.env()
    dispatcher = process_cluster.start_dispatcher("--worker-timeout-ms", "1000")
    workers = process_cluster.start_workers(2)
    mark = len(s3.recording.requests())
    out = tmp_path / "out.txt"
    # Each worker makes 60 samples/s (a pause per sample on the worker): after the trainer's
    # first 60 lines each has made about 30 of its first 40-sample shard, so the killed
    # worker surely holds one unfinished.
    reader = start_reader(process_cluster, s3, "tar", f"s3://{BUCKET}/shards/*.tar", out,
                          max_rate=60)
    wait_until(lambda: lines_in(out) >= 60 or reader.poll() is not None, 120,
               "the trainer's first 60 samples")
    workers[0].kill()  # not restarted: declared dead after 1 s, its shards handed again
    assert_one_epoch(finish(reader, out))
    assert "requeued" in dispatcher.output, dispatcher.output[-3000:]
    assert len(s3.recording.listings(mark)) == 1, s3.recording.listings(mark)


@pytest.mark.slow
def test_one_listing_per_registration_whatever_the_workers_and_executors(
        process_cluster: ProcessCluster, s3: S3Server, tmp_path: Path) -> None:
    process_cluster.env = s3.env()
    process_cluster.start_dispatcher()
    process_cluster.start_workers(2, processes=2)
    cases = [("tar", f"s3://{BUCKET}/shards/*.tar", sorted(expected_samples()),
              {f"shards/{i:03d}.tar" for i in range(SHARDS)}),
             ("files", f"s3://{BUCKET}/files/*.bin",
              [f"s3://{BUCKET}/files/{i}.bin {100 * (i + 1)}" for i in range(FILES)],
              {f"files/{i}.bin" for i in range(FILES)})]
    for source, url, expected, objects in cases:
        mark = len(s3.recording.requests())
        out = tmp_path / f"{source}.txt"
        got = finish(start_reader(process_cluster, s3, source, url, out), out)
        assert sorted(got) == expected
        listings = s3.recording.listings(mark)
        assert len(listings) == 1 and "list-type=2" in listings[0], listings
        # The workers read every object from the store (tds.read_bytes for list_files).
        assert {key for key, _ in s3.recording.object_reads(mark)} == objects


def test_a_shard_streams_from_the_store(s3: S3Server) -> None:
    """The first sample of a 30 MB shard comes after fetching a few blocks, not the shard."""
    mark = len(s3.recording.requests())
    code = ("import torch_dataservice as tds\n"
            f"sample = next(iter(tds.Pipeline.from_tar_shards('s3://{BUCKET}/big/*.tar')))\n"
            "print(sample['__key__'], len(sample['jpg']))\n")
    run = subprocess.run([sys.executable, "-c", code], env=s3.env(), cwd=str(REPO),
                         capture_output=True, text=True, timeout=120)
    assert run.stdout.split() == ["s000/00000", str(BIG_SAMPLE_BYTES)], run.stderr
    fetched = 0
    for key, byte_range in s3.recording.object_reads(mark):
        assert key == "big/000.tar" and byte_range is not None, (key, byte_range)
        first, last = byte_range.removeprefix("bytes=").split("-")
        fetched += int(last) - int(first) + 1
    assert 0 < fetched < len(big_shard()) / 2, (fetched, len(big_shard()))


@pytest.mark.parametrize(("credentials", "error"), [("wrong", "PermissionError"),
                                                    ("missing", "NoCredentialsError")])
def test_credentials_missing_or_wrong_fail_at_registration_naming_the_url(
        s3: S3Server, credentials: str, error: str) -> None:
    url = f"s3://{BUCKET}/shards/*.tar"
    code = ("import torch_dataservice as tds\n"
            f"pipeline = tds.Pipeline.from_tar_shards({url!r})\n"
            "tds.register_dataset('grpc://127.0.0.1:1', pipeline)\n")
    run = subprocess.run([sys.executable, "-c", code], env=s3.env(credentials), cwd=str(REPO),
                         capture_output=True, text=True, timeout=120)
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 1 and last.startswith(f"OSError: cannot list {url!r}"), run.stderr
    assert error in last, last

"""A real S3-compatible server for tests: moto's standalone server as its own process, with
IAM authentication on and every request it receives recorded (moto's recorder writes one JSON
line per request), so tests count requests at the server itself.

`S3Server` runs it on loopback; a fleet test runs `python -m moto.server` on a host of its own
and fills it from another host with `python -m tests.integration.object_store ENDPOINT`, which
prints the reader's access key and secret as JSON.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tests.conftest import HOST, free_port, subprocess_env, wait_until
from tests.pipeline.tar_support import numbered_samples, shard_bytes

BUCKET = "tds-data"
REGION = "us-east-1"
SHARDS, PER_SHARD, IMAGE_BYTES = 8, 40, 2000  # s3://BUCKET/shards/NNN.tar
FILES = 6  # s3://BUCKET/files/I.bin, 100 * (I + 1) bytes
BIG_SAMPLE_BYTES = 3 << 20  # s3://BUCKET/big/000.tar: 10 samples
ALLOW_S3 = json.dumps({"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]})
# What a process must not pick up from this machine: another account's settings.
_AWS_LEAKS = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


@functools.cache
def big_shard() -> bytes:
    return shard_bytes(numbered_samples(0, 10, image_bytes=BIG_SAMPLE_BYTES))


def expected_samples() -> list[str]:
    """The lines tests/integration/s3_reader.py writes for an epoch of the shards."""
    return [f"{key} {IMAGE_BYTES}" for shard in range(SHARDS)
            for key in numbered_samples(shard, PER_SHARD)]


def assert_one_epoch(lines: list[str]) -> None:
    """`lines` (s3_reader's, without "done") are every sample of the shards exactly once."""
    duplicated = {line: n for line, n in Counter(lines).items() if n > 1}
    missing = set(expected_samples()) - set(lines)
    assert not duplicated and not missing and len(lines) == SHARDS * PER_SHARD, (
        f"duplicated {duplicated}, missing {sorted(missing)[:10]} ({len(missing)})")


def fill(endpoint: str) -> tuple[str, str]:
    """Create the bucket, its objects and a reader's key, then turn authentication on; returns
    (access key, secret), the one key that authenticates from then on."""
    import boto3

    def client(service: str) -> Any:
        return boto3.client(service, endpoint_url=endpoint, region_name=REGION,
                            aws_access_key_id="setup", aws_secret_access_key="setup")

    iam = client("iam")
    iam.create_user(UserName="reader")
    iam.put_user_policy(UserName="reader", PolicyName="s3", PolicyDocument=ALLOW_S3)
    key = iam.create_access_key(UserName="reader")["AccessKey"]
    s3 = client("s3")
    s3.create_bucket(Bucket=BUCKET)
    for shard in range(SHARDS):
        s3.put_object(Bucket=BUCKET, Key=f"shards/{shard:03d}.tar", Body=shard_bytes(
            numbered_samples(shard, PER_SHARD, image_bytes=IMAGE_BYTES)))
    for i in range(FILES):
        s3.put_object(Bucket=BUCKET, Key=f"files/{i}.bin", Body=bytes(100 * (i + 1)))
    s3.put_object(Bucket=BUCKET, Key="big/000.tar", Body=big_shard())
    request = urllib.request.Request(f"{endpoint}/moto-api/reset-auth", data=b"0",
                                     method="POST", headers={"Content-Type": "text/plain"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        assert reply.status == 200, reply.read()
    return key["AccessKeyId"], key["SecretAccessKey"]


def client_env(base: dict[str, str], endpoint: str, key: str, secret: str,
               credentials: str = "valid") -> dict[str, str]:
    """`base` plus what reaches the store: `credentials` "valid", "wrong" or "missing"."""
    env = {k: v for k, v in base.items() if k not in _AWS_LEAKS}
    env.update(AWS_ENDPOINT_URL=endpoint, AWS_DEFAULT_REGION=REGION,
               AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=os.devnull,
               AWS_SHARED_CREDENTIALS_FILE=os.devnull)
    if credentials == "valid":
        env.update(AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret)
    elif credentials == "wrong":
        env.update(AWS_ACCESS_KEY_ID="AKIANOBODYKNOWSTHIS", AWS_SECRET_ACCESS_KEY="wrong")
    else:
        assert credentials == "missing", credentials
    return env


class Recording:
    """What the server saw: moto's recording file (MOTO_RECORDER_FILEPATH)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def requests(self, since: int = 0) -> list[dict]:
        """Requests received (method, url, headers), from the `since`-th on."""
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines()[since:]]

    def listings(self, since: int = 0) -> list[str]:
        """URLs of the requests that read the bucket itself (ListObjects and any other bucket
        call), rather than an object."""
        return [r["url"] for r in self.requests(since)
                if r["method"] == "GET" and urlparse(r["url"]).path.strip("/") == BUCKET]

    def object_reads(self, since: int = 0) -> list[tuple[str, str | None]]:
        """(object key, Range header) of each GET of an object."""
        reads = []
        for r in self.requests(since):
            path = urlparse(r["url"]).path.lstrip("/")
            if r["method"] == "GET" and path.startswith(f"{BUCKET}/"):
                reads.append((path[len(BUCKET) + 1:], r["headers"].get("Range")))
        return reads


class S3Server:
    """moto's S3 on 127.0.0.1, filled (see `fill`), authentication on."""

    def __init__(self, work_dir: Path) -> None:
        self.port = free_port()
        self.endpoint = f"http://{HOST}:{self.port}"
        self.recording = Recording(work_dir / "s3-requests.jsonl")
        self._log_path = work_dir / "moto.log"
        self._log = open(self._log_path, "w")  # closed in stop()
        env = subprocess_env(MOTO_ENABLE_RECORDING="1",
                             MOTO_RECORDER_FILEPATH=str(self.recording.path))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True)
        try:
            wait_until(self._listening, 60, f"moto's server on {self.endpoint}", 0.1)
            self.key, self.secret = fill(self.endpoint)
        except BaseException:
            self.stop()
            raise

    def _listening(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"moto's server exited with {self.proc.returncode}: "
                               f"{self._log_path.read_text()}")
        with socket.socket() as sock:
            return sock.connect_ex((urlparse(self.endpoint).hostname, self.port)) == 0

    def env(self, credentials: str = "valid") -> dict[str, str]:
        """A child's environment reaching this server."""
        return client_env(subprocess_env(), self.endpoint, self.key, self.secret, credentials)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._log.close()


if __name__ == "__main__":
    print(json.dumps(fill(sys.argv[1])))

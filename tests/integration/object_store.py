"""A real S3-compatible server for tests: moto's standalone server as its own process on
loopback, with IAM authentication on and every request it receives recorded (moto's recorder
writes one JSON line per request), so tests count requests at the server itself."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from tests.conftest import HOST, free_port, subprocess_env, wait_until

REGION = "us-east-1"
ALLOW_S3 = json.dumps({"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]})
# What a process must not pick up from this machine: another account's settings.
_AWS_LEAKS = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


class S3Server:
    """moto's S3 on 127.0.0.1. `bucket` is created; `allow_key`/`allow_secret` is the one
    access key that authenticates once `enforce_auth()` was called."""

    def __init__(self, work_dir: Path, bucket: str = "tds-data") -> None:
        self.bucket = bucket
        self.port = free_port()
        self.endpoint = f"http://{HOST}:{self.port}"
        self.recording = work_dir / "s3-requests.jsonl"
        self._log = open(work_dir / "moto.log", "w")  # closed in stop()
        env = subprocess_env(MOTO_ENABLE_RECORDING="1",
                             MOTO_RECORDER_FILEPATH=str(self.recording))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True)
        try:
            wait_until(self._listening, 60, f"moto's server on {self.endpoint}", 0.1)
            self._setup()
        except BaseException:
            self.stop()
            raise

    def _listening(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"moto's server exited with {self.proc.returncode}: "
                               f"{(self.recording.parent / 'moto.log').read_text()}")
        with socket.socket() as sock:
            return sock.connect_ex((HOST, self.port)) == 0

    def client(self, service: str) -> Any:
        """A boto3 client of this server (any key works until `enforce_auth`)."""
        import boto3

        return boto3.client(service, endpoint_url=self.endpoint, region_name=REGION,
                            aws_access_key_id="setup", aws_secret_access_key="setup")

    def _setup(self) -> None:
        iam = self.client("iam")
        iam.create_user(UserName="reader")
        iam.put_user_policy(UserName="reader", PolicyName="s3", PolicyDocument=ALLOW_S3)
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        self.allow_key, self.allow_secret = key["AccessKeyId"], key["SecretAccessKey"]
        self.client("s3").create_bucket(Bucket=self.bucket)

    def put(self, key: str, data: bytes) -> str:
        """Store an object (before `enforce_auth`); returns its s3:// URL."""
        self.client("s3").put_object(Bucket=self.bucket, Key=key, Body=data)
        return f"s3://{self.bucket}/{key}"

    def enforce_auth(self) -> None:
        """From now on a request must be signed with the reader's key (moto's IAM check)."""
        request = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", data=b"0",
                                         method="POST", headers={"Content-Type": "text/plain"})
        with urllib.request.urlopen(request, timeout=30) as reply:
            assert reply.status == 200, reply.read()

    def env(self, credentials: str = "valid") -> dict[str, str]:
        """A child's environment reaching this server: `credentials` "valid", "wrong" or
        "missing"."""
        env = {k: v for k, v in subprocess_env().items() if k not in _AWS_LEAKS}
        env.update(AWS_ENDPOINT_URL=self.endpoint, AWS_DEFAULT_REGION=REGION,
                   AWS_EC2_METADATA_DISABLED="true", AWS_CONFIG_FILE=os.devnull,
                   AWS_SHARED_CREDENTIALS_FILE=os.devnull)
        if credentials == "valid":
            env.update(AWS_ACCESS_KEY_ID=self.allow_key, AWS_SECRET_ACCESS_KEY=self.allow_secret)
        elif credentials == "wrong":
            env.update(AWS_ACCESS_KEY_ID="AKIANOBODYKNOWSTHIS", AWS_SECRET_ACCESS_KEY="wrong")
        else:
            assert credentials == "missing", credentials
        return env

    # ----------------------------------------------------------------- what the server saw
    def requests(self, since: int = 0) -> list[dict]:
        """Requests received (method, url, headers), from the `since`-th on."""
        if not self.recording.exists():
            return []
        return [json.loads(line) for line in self.recording.read_text().splitlines()[since:]]

    def listings(self, since: int = 0) -> list[str]:
        """URLs of the requests that read the bucket itself (ListObjects and any other bucket
        call), rather than an object."""
        return [r["url"] for r in self.requests(since)
                if r["method"] == "GET" and urlparse(r["url"]).path.strip("/") == self.bucket]

    def object_reads(self, since: int = 0) -> list[tuple[str, str | None]]:
        """(object key, Range header) of each GET of an object."""
        reads = []
        for r in self.requests(since):
            path = urlparse(r["url"]).path.lstrip("/")
            if r["method"] == "GET" and path.startswith(f"{self.bucket}/"):
                reads.append((path[len(self.bucket) + 1:], r["headers"].get("Range")))
        return reads

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._log.close()


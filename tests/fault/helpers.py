"""Shared by the fault tests: a consumer subprocess, the delivered/missing/duplicated count, and
a map function that names the process that ran it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO, ProcessCluster


@dataclass
class Tally:
    delivered: int
    missing: int
    duplicated: int
    done: bool

    def __str__(self) -> str:
        return (f"delivered={self.delivered} missing={self.missing} "
                f"duplicated={self.duplicated} done={self.done}")


def tally(out: Path, n: int) -> Tally:
    return tally_all([out], n)


def tally_all(outs: list[Path], n: int) -> Tally:
    """What consumers sharing one job received together (done: every one ended cleanly)."""
    values: Counter[int] = Counter()
    done = True
    for out in outs:
        lines = out.read_text().splitlines() if out.exists() else []
        done = done and bool(lines) and lines[-1] == "done"
        values.update(int(line) for line in lines if line and line != "done")
    return Tally(delivered=sum(values.values()),
                 missing=sum(1 for i in range(n) if i not in values),
                 duplicated=sum(count - 1 for count in values.values() if count > 1),
                 done=done)


def received(out: Path) -> int:
    try:
        return out.read_text().count("\n")
    except FileNotFoundError:
        return 0


class Consumer:
    """`python -m tests.fault.consumer` reading a DYNAMIC epoch of range(n)."""

    def __init__(self, cluster: ProcessCluster, n: int, out: Path, job_name: str,
                 max_rate: float = 0.0, flush_every: int = 256, go: Path | None = None,
                 cache_dir: Path | None = None) -> None:
        """With `go`, the consumer reads only once that file exists (see `start_together`);
        with `cache_dir`, its pipeline caches (tests/fault/consumer.py)."""
        assert cluster.dispatcher is not None
        self.out = out
        self.n = n
        self.log = out.with_suffix(".log")
        self._log_file = open(self.log, "w")  # noqa: SIM115 - closed in wait()
        env = dict(cluster.env)
        if go is not None:
            env["TDS_TEST_CONSUMER_GO"] = str(go)
        if cache_dir is not None:
            env["TDS_TEST_CONSUMER_CACHE"] = str(cache_dir)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fault.consumer", cluster.dispatcher.address, str(n),
             str(out), job_name, str(max_rate), str(flush_every)],
            cwd=str(REPO), env=env,
            stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.ready = Path(f"{out}.ready")

    @staticmethod
    def start_together(consumers: list[Consumer], go: Path, timeout_s: float) -> None:
        """Let consumers created with `go` read, once all of them are ready: one slow to import
        torch on a busy machine would otherwise find the epoch read by the others."""
        deadline = time.monotonic() + timeout_s
        while not all(c.ready.exists() for c in consumers):
            for c in consumers:
                assert c.proc.poll() is None, f"consumer exited before it was ready:\n{c.output()}"
            assert time.monotonic() < deadline, f"consumers not ready after {timeout_s} s"
            time.sleep(0.05)
        go.touch()

    def wait_received(self, count: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            if received(self.out) >= count:
                return True
            time.sleep(0.05)
        return received(self.out) >= count

    def wait(self, timeout_s: float) -> Tally:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log_file.close()
        return tally(self.out, self.n)

    def output(self) -> str:
        return self.log.read_text()[-3000:]


def tag_with_pid(x: int) -> tuple[int, int]:
    """Which worker (its single executor process) made element x."""
    return os.getpid(), x


def read_coordinated(target: str, mode: str, job_name: str, consumer: int, got: list,
                     errors: list, stop: threading.Event) -> None:
    """Consumer `consumer` of 2 coordinated consumers of `job_name`, appending
    `tag_with_pid` elements to `got` (a 4-ms training step each) until `stop`; an error goes
    to `errors`."""
    import torch_dataservice as tds

    pipeline = tds.Pipeline.range(10**9).map(tag_with_pid).apply(tds.distribute(
        mode, target, job_name=job_name, consumer_index=consumer, num_consumers=2))
    try:
        for element in pipeline:
            got.append(element)
            if stop.is_set():
                return
            time.sleep(0.004)  # a training step
    except BaseException as error:  # noqa: BLE001 - reported by the test
        errors.append(error)

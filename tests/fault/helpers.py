"""Shared by the fault tests: a consumer subprocess and the delivered/missing/duplicated count."""

from __future__ import annotations

import subprocess
import sys
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
                 max_rate: float = 0.0, flush_every: int = 256) -> None:
        assert cluster.dispatcher is not None
        self.out = out
        self.n = n
        self.log = out.with_suffix(".log")
        self._log_file = open(self.log, "w")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.fault.consumer", cluster.dispatcher.address, str(n),
             str(out), job_name, str(max_rate), str(flush_every)],
            cwd=str(REPO), env=cluster.env, stdout=self._log_file, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL)

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

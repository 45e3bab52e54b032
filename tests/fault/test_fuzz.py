"""Fuzzing as a test (issue 15.6): a short seeded run of tests/fault/fuzz.py against real
in-process servers — random and mutated requests to every dispatcher and worker RPC and to
the data port. No handler fails (INTERNAL), no RPC hits its deadline, threads and memory do
not grow, and an exactly-once epoch is read afterwards. Longer runs: see the script."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, subprocess_env

pytestmark = pytest.mark.integration


@pytest.mark.timeout(180)
@pytest.mark.parametrize("seed", [11, 12])
def test_fuzzed_servers_keep_serving_exactly_once(seed: int) -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "fault" / "fuzz.py"), "--cases", "1500",
         "--seed", str(seed)],
        capture_output=True, text=True, timeout=170, env=subprocess_env(), cwd=REPO)
    summary = result.stdout[-3000:]
    assert result.returncode == 0 and "PASSED" in result.stdout, (
        f"{summary}\n{result.stderr[-3000:]}")
    assert "handler failures (INTERNAL): 0" in summary
    assert "exactly-once epoch afterwards: ok" in summary

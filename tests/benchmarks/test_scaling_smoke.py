"""Smoke test: benchmarks/scaling.py runs a tiny fleet and prints its figure lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_scaling_runs_and_prints_its_table(tmp_path: Path) -> None:
    out = tmp_path / "scaling.json"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "scaling.py"), "--workers", "1,2",
         "--consumers", "1", "--seconds", "0.5", "--no-diagnostic", "--json", str(out)],
        capture_output=True, text=True, timeout=220, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ratio" in result.stdout and "linear" in result.stdout
    rows = json.loads(out.read_text())["rows"]
    # two workers' rate as a ratio to one's, measured in the same run
    assert {(r["consumers"], r["workers"]) for r in rows} == {(1, 1), (1, 2)}
    assert all(r["rate"] > 0 and r["ratio"] > 0 for r in rows)

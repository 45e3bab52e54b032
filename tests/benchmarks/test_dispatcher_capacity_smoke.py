"""Smoke test: benchmarks/dispatcher_capacity.py runs tiny steps and prints its figure lines."""

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
@pytest.mark.timeout(180)
def test_dispatcher_capacity_runs_and_prints_its_table(tmp_path: Path) -> None:
    out = tmp_path / "capacity.json"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "dispatcher_capacity.py"), "--workers", "2,4",
         "--clients", "2,3", "--seconds", "1", "--ramp", "1", "--procs", "2",
         "--modes", "memory,journal", "--json", str(out)],
        capture_output=True, text=True, timeout=160, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "disp cores" in result.stdout and "p99 ms" in result.stdout
    assert "memory: within" in result.stdout and "journal: within" in result.stdout
    written = json.loads(out.read_text())
    # The workers' split stocks ask as the real ones do, from a dataset no window exhausts.
    assert written["stock_depth"] == 64 and written["dataset_elements"] >= 10**9
    rows = written["rows"]
    assert [(r["mode"], r["workers"], r["clients"]) for r in rows] == [
        ("memory", 2, 2), ("memory", 4, 3), ("journal", 2, 2), ("journal", 4, 3)]
    assert all(r["split_rps"] > 0 and r["split_p50_ms"] > 0 and r["splits_per_ask"] >= 1
               and r["attempted_rps"] >= r["achieved_rps"] for r in rows)
    # A small fleet: the default intervals, nothing refused, the simulators' CPU apart.
    # (Run beside the rest of the suite: a busy host must not make it refuse or stretch.)
    assert all(r["worker_interval_ms"] == 500 and r["client_interval_ms"] == 100
               and r["refused_rps"] == 0 and r["sim_cores"] > 0 for r in rows), rows
    assert all(r["offered_rps"] > 0 and r["achieved_rps"] > 0 and r["cores"] > 0 for r in rows)
    # GetSplit as the dispatcher timed it (its histogram, scraped around each window).
    assert all(r["server_split_p99_ms"] > 0 and 0 < r["server_split_within_50ms"] <= 1
               for r in rows)
    # GetSplit end to end, as one more worker in a favoured process of its own saw it.
    assert all(r["probe_splits"] > 0 and r["probe_split_p99_ms"] >= r["probe_split_p50_ms"] > 0
               for r in rows), rows

"""A DYNAMIC Pipeline under real torchrun (gloo, CPU): 2 ranks train k steps, save
`{"model", "loader": loader.state_dict()}`, train on (data the checkpoint does not count) and
are SIGKILLed as a whole process group; the dispatcher restarts from its journal; 3 ranks
resume from the checkpoint. Together they read
the epoch exactly once, minus what `even_batches` drops at the end (coordinated reads: the last
incomplete round of each task), with equal batch counts per rank."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

import torch_dataservice as tds
from tests.conftest import HOST, REPO, Cluster, subprocess_env, wait_until

SAMPLES, SPLIT, BATCH, SAVE_AT = 192, 8, 4, 4
SCRIPT = Path(__file__).with_name("ddp_pipeline_resume.py")


def torchrun(cluster: Cluster, directory: Path, ranks: int, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={ranks}", str(SCRIPT), "--service", cluster.target,
               "--samples", str(SAMPLES), "--split-size", str(SPLIT),
               "--batch-size", str(BATCH), "--dir", str(directory), *extra]
    env = subprocess_env(OMP_NUM_THREADS="1")
    env.pop("TORCH_DATASERVICE_ADDRESS", None)
    return subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def records(directory: Path, ranks: int) -> list[list[dict]]:
    return [[json.loads(line) for line in (directory / f"rank{r}.jsonl").read_text().splitlines()]
            for r in range(ranks)]


@pytest.mark.slow
@pytest.mark.timeout(180)
def kill_job(job: subprocess.Popen) -> None:
    """SIGKILL torchrun and every rank: torchrun starts each rank in a session of its own, so
    killing its process group alone would leave the ranks running."""
    try:
        ranks = psutil.Process(job.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        ranks = []
    os.killpg(job.pid, signal.SIGKILL)
    for rank in ranks:
        with contextlib.suppress(psutil.NoSuchProcess):
            rank.kill()
    job.wait(timeout=10)
    psutil.wait_procs(ranks, timeout=10)


def test_a_killed_two_rank_run_resumes_on_three_ranks(cluster_factory, tmp_path: Path) -> None:
    work_dir = str(tmp_path / "work")
    cluster = cluster_factory(1, fault_tolerant_mode=True, work_dir=work_dir)
    first = torchrun(cluster, tmp_path, 2, "--save-at", str(SAVE_AT))
    try:
        wait_until(lambda: all((tmp_path / f"ready{r}").exists() for r in range(2))
                   or first.poll() is not None, 60, "the first run to save and go on")
        assert first.poll() is None, first.communicate()[0][-4000:]
    finally:
        kill_job(first)  # the whole job, as a preemption does
    before = records(tmp_path, 2)
    for rank in range(2):
        (tmp_path / f"rank{rank}.jsonl").rename(tmp_path / f"killed{rank}.jsonl")
    # The dispatcher restarts (from its journal) between the save and the resume too.
    port = cluster.dispatcher.port
    cluster.dispatcher.stop()
    cluster.dispatcher = tds.DispatchServer(tds.DispatcherConfig(
        host=HOST, port=port, fault_tolerant_mode=True, work_dir=work_dir))
    second = torchrun(cluster, tmp_path, 3, "--resume")
    try:
        output = second.communicate(timeout=90)[0]
    except subprocess.TimeoutExpired:
        kill_job(second)
        pytest.fail(f"the resumed run hung: {second.communicate()[0][-4000:]}")
    assert second.returncode == 0, output[-4000:]
    after = records(tmp_path, 3)

    saved = [[s for line in rank if line["phase"] == "before" for s in line["samples"]]
             for rank in before]
    assert [len(s) for s in saved] == [SAVE_AT * BATCH] * 2
    counts = [len(rank) for rank in after]
    assert len(set(counts)) == 1 and counts[0] > 0, counts  # DDP never waits for a rank
    seen = [s for part in saved for s in part] + [
        s for rank in after for line in rank for s in line["samples"]]
    assert len(seen) == len(set(seen)), "a sample was read twice"
    missing = set(range(SAMPLES)) - set(seen)
    # even_batches: each task's last incomplete round (< 3 batches of the 1 worker) is dropped.
    assert len(missing) <= 2 * BATCH, sorted(missing)
    assert any(line["phase"] == "after-save" for rank in before for line in rank)

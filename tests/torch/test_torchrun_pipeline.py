"""A DYNAMIC Pipeline under real torchrun (gloo, CPU), resumed from one checkpoint three ways.

`torchrun --max-restarts=1` runs 2 ranks of tests/torch/ddp_pipeline_resume.py: they train k
steps, save `{"model", "loader": loader.state_dict()}`, train on (data the checkpoint does not
count), and then one rank dies on its own. torchrun restarts the group; the restarted ranks
re-create their loaders (which join new jobs, named with the restart count), load the
checkpoint, finish the epoch and read the next one. From that same checkpoint (the 2-rank run
happens once per module) 3 ranks resume after a dispatcher restart from its journal, and 1 rank
resumes (a process alone, as one-GPU training starts). Each time the samples before the save
and after the resume make the epoch exactly once, minus what `even_batches` drops at the end
(coordinated reads: each task's last incomplete round, fewer than `ranks` batches of its
worker), every rank yields as many batches, and the next epoch is a whole one again.

The restart is tested on the Pipeline trainer rather than the map-style one
(test_resume_torchrun.py): its first attempt doubles as the 2-rank run that makes the
checkpoint, so the restart costs one group start and no extra torchrun; and its jobs are named
(one job shared by all ranks), so the dispatcher's status shows which job each group read.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

import torch_dataservice as tds
from tests.conftest import HOST, REPO, Cluster, _make_cluster, subprocess_env
from tests.torch.conftest import launch
from torch_dataservice.observability.status_text import fetch_status

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]

SAMPLES, SPLIT, BATCH, SAVE_AT, EPOCHS = 192, 8, 4, 4, 2
RUN_S = 120.0
SCRIPT = Path(__file__).with_name("ddp_pipeline_resume.py")


@dataclass
class Saved:
    cluster: Cluster
    journal: str
    checkpoint: Path
    first: list[list[dict]]  # every rank's records of the --max-restarts run, both attempts
    jobs: list[tuple[int, str]]  # (job id, job name) of the dataloader jobs after that run


def kill_job(job: subprocess.Popen) -> None:
    """SIGKILL torchrun and every rank: torchrun starts each rank in a session of its own, so
    killing its process group alone would leave the ranks running."""
    try:
        ranks = psutil.Process(job.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        ranks = []
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)
    for rank in ranks:
        with contextlib.suppress(psutil.NoSuchProcess):
            rank.kill()
    job.wait(timeout=10)
    psutil.wait_procs(ranks, timeout=10)


def run(cluster: Cluster, checkpoint: Path, records: Path, ranks: int, *torchrun_args: str,
        save_at: int = 0, **env_extra: str) -> list[list[dict]]:
    """Run the trainer as `ranks` ranks to its end (it must exit 0); every rank's records."""
    command, rank_env = launch(ranks, SCRIPT, *torchrun_args)
    command += ["--service", cluster.target, "--samples", str(SAMPLES),
                "--split-size", str(SPLIT), "--batch-size", str(BATCH), "--epochs", str(EPOCHS),
                "--save-at", str(save_at), "--checkpoint", str(checkpoint), "--dir", str(records)]
    env = subprocess_env(OMP_NUM_THREADS="1", **rank_env, **env_extra)
    env.pop("TORCH_DATASERVICE_ADDRESS", None)
    job = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output = job.communicate(timeout=RUN_S)[0]
    except subprocess.TimeoutExpired:
        kill_job(job)
        pytest.fail(f"the {ranks}-rank run hung: {job.communicate()[0][-4000:]}")
    records.mkdir(parents=True, exist_ok=True)
    (records / "torchrun.log").write_text(output)
    assert job.returncode == 0, output[-4000:]
    return [[json.loads(line) for line in (records / f"rank{r}.jsonl").read_text().splitlines()]
            for r in range(ranks)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Saved]:
    """The 2-rank run under `--max-restarts=1`: one rank dies after the save, the restarted
    group resumes from the checkpoint (one per module: the tests resume from it too)."""
    work = tmp_path_factory.mktemp("torchrun_pipeline")
    journal = str(work / "journal")
    cluster = _make_cluster(1, fault_tolerant_mode=True, work_dir=journal)
    try:
        checkpoint = work / "checkpoint.pt"
        # torch's workaround for pytorch/pytorch#135712: with the rendezvous store shared by
        # the agent (the default), the restarted ranks can read the dead ranks' gloo addresses
        # from it and fail init_process_group (connection refused).
        first = run(cluster, checkpoint, work / "two", 2, "--max-restarts=1", save_at=SAVE_AT,
                    TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        jobs = sorted((i.job_id, i.job_name) for i in fetch_status(cluster.target).iterations
                      if "tds-dataloader-" in i.job_name)
        yield Saved(cluster, journal, checkpoint, first, jobs)
    finally:
        cluster.stop()


def before_the_save(saved: Saved) -> list[int]:
    """The samples the 2 ranks had been given when they saved."""
    return [s for rank in saved.first for line in rank
            if line["attempt"] == 0 and line["phase"] == "before" for s in line["samples"]]


def check_epochs(before: list[int], runs: list[list[dict]]) -> None:
    """The resumed epoch with `before` is the epoch once, the next one whole; minus the drop."""
    ranks = len(runs)
    for epoch in range(EPOCHS):
        per_rank = [[line["samples"] for line in run if line["epoch"] == epoch] for run in runs]
        counts = [len(batches) for batches in per_rank]
        assert len(set(counts)) == 1 and counts[0] > 0, (epoch, counts)  # DDP never waits
        seen = [s for batches in per_rank for batch in batches for s in batch]
        if epoch == 0:
            seen += before
        assert len(seen) == len(set(seen)), f"epoch {epoch}: a sample was read twice"
        missing = set(range(SAMPLES)) - set(seen)
        # even_batches: the one worker's last incomplete round (< `ranks` batches) is dropped.
        assert len(missing) <= (ranks - 1) * BATCH, (epoch, sorted(missing))


def test_a_rank_that_dies_is_restarted_by_torchrun_into_new_jobs_from_the_checkpoint(
        saved: Saved) -> None:
    before = before_the_save(saved)
    assert len(before) == 2 * SAVE_AT * BATCH
    first = [[line for line in rank if line["attempt"] == 0] for rank in saved.first]
    # Both ranks trained past the save before one died: data the checkpoint does not count.
    assert all(any(line["phase"] == "after-save" for line in rank) for rank in first)
    restarted = [[line for line in rank if line["attempt"] == 1] for rank in saved.first]
    assert all(line["phase"] == "resumed" for rank in restarted for line in rank)
    check_epochs(before, restarted)
    # The first group read one job; the restarted group read new ones (its epoch 0, resumed,
    # and epoch 1), named with the restart count: never the first group's job.
    first_jobs = [job for job in saved.jobs if "-restart1-" not in job[1]]
    new_jobs = [job for job in saved.jobs if "-restart1-" in job[1]]
    assert len(first_jobs) == 1 and len(new_jobs) == EPOCHS, saved.jobs
    assert first_jobs[0][0] not in {job_id for job_id, _ in new_jobs}


def test_two_ranks_resume_on_three_after_a_dispatcher_restart(saved: Saved,
                                                              tmp_path: Path) -> None:
    cluster = saved.cluster
    port = cluster.dispatcher.port
    cluster.dispatcher.stop()
    cluster.dispatcher = tds.DispatchServer(tds.DispatcherConfig(
        host=HOST, port=port, fault_tolerant_mode=True, work_dir=saved.journal))
    runs = run(cluster, saved.checkpoint, tmp_path, 3)
    assert all(line["phase"] == "resumed" for rank in runs for line in rank)
    check_epochs(before_the_save(saved), runs)


def test_two_ranks_resume_on_one(saved: Saved, tmp_path: Path) -> None:
    check_epochs(before_the_save(saved), run(saved.cluster, saved.checkpoint, tmp_path, 1))

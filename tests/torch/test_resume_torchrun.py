"""Resume at another world size with real torchrun (gloo, CPU): tests/torch/resume_trainer.py
trains 2 ranks on a map-style dataset from a service of CLI processes, saves
`{"model", "loader": loader.state_dict()}` after a few steps while the service has run ahead
(slow steps, deep prefetch), goes on, and is SIGKILLed as a whole. From that one checkpoint it
is restarted with 3 ranks (after the dispatcher was killed and restarted from its journal) and
with 1 rank (a process alone, as one-GPU training starts): each time the samples before the
save and after the restart make the epoch exactly once but for the documented drop, every rank
yields as many batches (and `len(loader)` says so), and the next epoch is the one an
uninterrupted run at that world size yields.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO, ProcessCluster, subprocess_env
from tests.torch import resume_trainer
from tests.torch.conftest import launch
from torch_dataservice.torch import sampling

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(120)]

SAMPLES, BATCH, SAVE_AT = 103, 4, 4  # 2 ranks: 51 samples (13 batches) each, 1 dropped
RUN_S = 45.0


@dataclass
class Saved:
    cluster: ProcessCluster
    checkpoint: Path
    records: Path
    before: list[int]  # the samples the 2 ranks had been given at the save


def torchrun(cluster: ProcessCluster, ranks: int, checkpoint: Path, record: Path,
             *extra: str) -> subprocess.Popen[bytes]:
    """Start the trainer as `ranks` ranks (torchrun, or one process alone); its output goes
    to RECORD.log (a pipe nobody reads could fill up and block it)."""
    command, rank_env = launch(ranks, Path(resume_trainer.__file__))
    command += ["--service", cluster.target, "--samples", str(SAMPLES),
                "--batch-size", str(BATCH), "--epochs", "2", "--checkpoint", str(checkpoint),
                "--record", str(record), *extra]
    env = subprocess_env(OMP_NUM_THREADS="1", **rank_env)
    env.pop("TORCH_DATASERVICE_ADDRESS", None)
    record.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{record}.log", "wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                start_new_session=True)


def output(record: Path) -> str:
    return Path(f"{record}.log").read_text(errors="replace")[-4000:]


def lines(record: Path, rank: int) -> list[dict]:
    path = Path(f"{record}.rank{rank}.jsonl")
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def kill_job(job: subprocess.Popen[bytes], record: Path, ranks: int) -> None:
    """SIGKILL torchrun and every rank (torchrun starts each rank in a session of its own)."""
    pids = [line["pid"] for rank in range(ranks) for line in lines(record, rank)[:1]]
    for pid in [job.pid, *pids]:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.wait(timeout=10)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Saved]:
    """The 2-rank run, killed just after its save (one per module: the tests resume from it)."""
    work = tmp_path_factory.mktemp("resume_torchrun")
    cluster = ProcessCluster()
    try:
        cluster.start_dispatcher("--fault-tolerant", "--work-dir", str(work / "journal"),
                                 "--worker-timeout-ms", "3000")
        cluster.start_worker()
        checkpoint, record = work / "checkpoint.pt", work / "records" / "first"
        job = torchrun(cluster, 2, checkpoint, record, "--save-at", str(SAVE_AT),
                       "--step-seconds", "0.15")
        deadline = time.monotonic() + RUN_S
        # Killed once both ranks went past the save: they train on from there, as a real job.
        while not (checkpoint.exists() and all(
                any(line.get("step", 0) > SAVE_AT for line in lines(record, rank))
                for rank in range(2))):
            if job.poll() is not None or time.monotonic() > deadline:
                kill_job(job, record, 2)
                pytest.fail(f"the 2-rank run did not save:\n{output(record)}")
            time.sleep(0.05)
        alive = job.poll() is None
        kill_job(job, record, 2)
        assert alive, "the 2-rank run ended by itself instead of being killed"
        before = [i for rank in range(2) for line in lines(record, rank)
                  if 0 < line.get("step", 0) <= SAVE_AT for i in line["indices"]]
        yield Saved(cluster, checkpoint, work / "records", before)
    finally:
        cluster.close()


def resume(saved: Saved, ranks: int, tag: str) -> list[list[dict]]:
    """Restart from the checkpoint with `ranks` ranks; every rank's record of that run."""
    record = saved.records / tag
    job = torchrun(saved.cluster, ranks, saved.checkpoint, record)
    try:
        job.wait(timeout=RUN_S)
    except subprocess.TimeoutExpired:
        kill_job(job, record, ranks)
        pytest.fail(f"the {ranks}-rank run hung:\n{output(record)}")
    assert job.returncode == 0, output(record)
    return [lines(record, rank) for rank in range(ranks)]


def check_resumed(saved: Saved, runs: list[list[dict]]) -> None:
    import torch

    ranks = len(runs)
    state = torch.load(saved.checkpoint, weights_only=False)["loader"]
    assert state["epoch"] == 0 and state["consumed_ranges"] == [[0, 2 * BATCH * SAVE_AT]]
    remaining = SAMPLES - len(saved.before)
    for epoch, dropped in ((0, remaining % ranks), (1, SAMPLES % ranks)):
        per_rank = [[line["indices"] for line in run if line.get("epoch") == epoch
                     and "indices" in line] for run in runs]
        lengths = [line["len"] for run in runs for line in run
                   if line.get("epoch") == epoch and "len" in line]
        counts = [len(batches) for batches in per_rank]
        assert len(set(counts)) == 1 and lengths == counts, (epoch, counts, lengths)
        seen = [i for batches in per_rank for batch in batches for i in batch]
        if epoch == 0:  # the remainder: with what was seen before the save, the epoch once
            seen += saved.before
        assert len(seen) == len(set(seen)), "a sample twice"
        assert len(seen) == SAMPLES - dropped, (epoch, len(seen), dropped)
    for rank, run in enumerate(runs):  # the next epoch: an uninterrupted run's at this size
        order = sampling.seeded_default_order(SAMPLES, True, resume_trainer.SEED, 1, rank, ranks)
        assert [line["indices"] for line in run if line.get("epoch") == 1
                and "indices" in line] == sampling.batched(order, BATCH, False)


def test_the_state_is_what_the_trainer_was_given_not_what_the_service_made(
        saved: Saved) -> None:
    import torch

    checkpoint = torch.load(saved.checkpoint, weights_only=False)
    stats = checkpoint["stats"]  # rank 0's, at the save
    assert stats["batches"] == SAVE_AT
    assert stats["elements"] > SAVE_AT + 2, stats  # the service had made more than that
    assert len(saved.before) == len(set(saved.before)) == 2 * BATCH * SAVE_AT


def test_two_ranks_resume_on_three_after_a_dispatcher_restart(saved: Saved) -> None:
    dispatcher = saved.cluster.dispatcher
    assert dispatcher is not None
    dispatcher.signal(signal.SIGKILL)
    dispatcher.wait_exit()
    dispatcher.restart()  # same port, same journal
    check_resumed(saved, resume(saved, 3, "three"))


def test_two_ranks_resume_on_one(saved: Saved) -> None:
    check_resumed(saved, resume(saved, 1, "one"))

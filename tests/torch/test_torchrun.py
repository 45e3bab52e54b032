"""examples/train_ddp.py under torchrun: two ranks, DDP over gloo, data from the service.

One run is preempted mid-epoch and a second one resumes from the checkpoint, so the test sees
both the rank split (disjoint, equal batch counts although 101 samples do not divide evenly,
reshuffled per epoch) and resume under torchrun (no sample lost or repeated).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, Cluster, subprocess_env

SAMPLES, BATCH, RANKS, EPOCHS = 101, 8, 2, 2



def torchrun(cluster: Cluster, tmp_path: Path, *extra: str) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={RANKS}", str(REPO / "examples" / "train_ddp.py"),
               "--service", cluster.target, "--epochs", str(EPOCHS), "--samples", str(SAMPLES),
               "--batch-size", str(BATCH), "--record", str(tmp_path / "record"),
               "--checkpoint", str(tmp_path / "checkpoint"), *extra]
    env = subprocess_env(OMP_NUM_THREADS="1")
    env.pop("TORCH_DATASERVICE_ADDRESS", None)
    try:
        result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO,
                                timeout=55)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"torchrun hung:\n{error.stdout}\n{error.stderr}")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-4000:]}"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_ddp_ranks_are_disjoint_even_and_resumable(cluster: Cluster, tmp_path: Path) -> None:
    torchrun(cluster, tmp_path, "--max-steps", "8")  # preempted in epoch 1 (7 batches per epoch)
    torchrun(cluster, tmp_path)                       # resumes mid-epoch 1
    runs = {rank: json.loads((tmp_path / "record" / f"rank{rank}.json").read_text())
            for rank in range(RANKS)}
    assert all(len(r) == 2 for r in runs.values())
    per_rank_batches = SAMPLES // RANKS // BATCH + (SAMPLES // RANKS % BATCH > 0)  # 7
    orders = []
    for epoch in map(str, range(EPOCHS)):
        seen: list[int] = []
        counts = []
        for rank in range(RANKS):
            batches = [b for run in runs[rank] for b in run["epochs"].get(epoch, [])]
            counts.append(len(batches))
            seen += [i for batch in batches for i in batch]
            if rank == 0:
                orders.append([i for batch in batches for i in batch])
        assert counts == [per_rank_batches] * RANKS  # equal: DDP never waits for a rank
        assert len(seen) == len(set(seen)) == SAMPLES - SAMPLES % RANKS  # disjoint, complete
    assert orders[0] != orders[1]  # reshuffled per epoch
    # The first run stopped mid-epoch 1 and the second resumed there: together, one epoch.
    assert [len(runs[0][i]["epochs"].get("1", [])) for i in range(2)] == [1, 6]

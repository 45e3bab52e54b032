"""examples/train_ddp.py under torchrun: two ranks, DDP over gloo, data from the service.

One run, preempted (`--max-steps`) one step into its second epoch: the ranks' batches are
disjoint, as many on each rank although 101 samples do not divide evenly, in `set_epoch`'s
seeded order (reshuffled per epoch), and the checkpoint each rank saved holds the same global
loader state at that step. Resuming from such a state under torchrun, at this world size and
others, is tests/torch/test_resume_torchrun.py's (map-style) and test_torchrun_pipeline.py's
(DYNAMIC Pipeline, after a `--max-restarts` restart); this test keeps the example honest with
one torchrun start instead of two.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, Cluster, subprocess_env
from torch_dataservice.torch import sampling

pytestmark = pytest.mark.integration

SAMPLES, BATCH, RANKS, SEED = 101, 8, 2, 1234  # SEED: the example's generator
PER_RANK = -(-(SAMPLES // RANKS) // BATCH)  # 7 batches per rank and epoch


def torchrun(cluster: Cluster, tmp_path: Path, *extra: str) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={RANKS}", str(REPO / "examples" / "train_ddp.py"),
               "--service", cluster.target, "--epochs", "2", "--samples", str(SAMPLES),
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
def test_ddp_ranks_are_disjoint_even_reshuffled_and_save_one_state(
        cluster: Cluster, tmp_path: Path) -> None:
    torchrun(cluster, tmp_path, "--max-steps", str(PER_RANK + 1))  # preempted in epoch 1
    runs = [json.loads((tmp_path / "record" / f"rank{rank}.json").read_text())
            for rank in range(RANKS)]
    assert [len(run) for run in runs] == [1] * RANKS
    epochs = [run[0]["epochs"] for run in runs]
    assert [len(e["0"]) for e in epochs] == [PER_RANK] * RANKS  # equal: DDP never waits
    assert [len(e["1"]) for e in epochs] == [1] * RANKS
    for epoch in ("0", "1"):
        seen = [i for e in epochs for batch in e[epoch] for i in batch]
        assert len(seen) == len(set(seen)), f"epoch {epoch}: a sample on two ranks"
    seen = [i for e in epochs for batch in e["0"] for i in batch]
    assert len(seen) == SAMPLES - SAMPLES % RANKS  # complete but the drop
    for rank in range(RANKS):  # set_epoch's order: DistributedSampler's, seeded, per epoch
        orders = [sampling.batched(sampling.seeded_default_order(
            SAMPLES, True, SEED, epoch, rank, RANKS), BATCH, False) for epoch in (0, 1)]
        assert orders[0] != orders[1]  # reshuffled
        assert epochs[rank]["0"] == orders[0] and epochs[rank]["1"] == orders[1][:1]
    states = [torch.load(tmp_path / "checkpoint" / f"rank{rank}.pt", weights_only=False)["loader"]
              for rank in range(RANKS)]
    assert states[0] == states[1], "every rank saves the same loader state"
    assert states[0]["epoch"] == 1 and states[0]["in_progress"]
    assert states[0]["consumed_ranges"] == [[0, RANKS * BATCH]]  # one batch of each rank

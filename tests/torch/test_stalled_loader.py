"""A training step that holds the GIL for longer than job_gc_timeout_ms starves the loader's
heartbeat: the dispatcher releases its reader and collects the epoch's iteration and its
ephemeral dataset. The loader registers what it had not yielded again, as a resumed loader
would, and the epoch ends complete, exactly once, in torch's order. A CLI dispatcher and
worker, the loader in a script of its own (the stall holds its whole interpreter)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, ProcessCluster

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(180)]

STALL_S = 4.0  # > job_gc_timeout_ms (300) + two of the dispatcher's checks (1 s each)

SCRIPT = """
import sys, time
import torch
from torch.utils.data import DataLoader, Dataset
import torch_dataservice as tds

class Numbers(Dataset):
    # 5 ms a sample: the epoch takes the worker about 2 s, so the loader cannot have fetched
    # it all by the stall (step 10), which would leave nothing to register again.
    slow = True
    def __len__(self):
        return 400
    def __getitem__(self, i):
        if self.slow:
            time.sleep(0.005)
        return torch.tensor([i])

def hold_the_gil(seconds):
    # A long pure-Python step that no other thread of this process interrupts.
    previous = sys.getswitchinterval()
    sys.setswitchinterval(seconds + 60)
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    finally:
        sys.setswitchinterval(previous)

if __name__ == "__main__":
    target, stall = sys.argv[1], float(sys.argv[2])
    ours = tds.DataLoader(Numbers(), batch_size=4, shuffle=True, service=target,
                          generator=torch.Generator().manual_seed(7))
    fast = Numbers()
    fast.slow = False
    theirs = [b.flatten().tolist() for b in DataLoader(
        fast, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))]
    got = []
    for step, batch in enumerate(ours):
        got.append(batch.flatten().tolist())
        if step == 10:
            hold_the_gil(stall)
    print("batches", len(got), "of", len(theirs), flush=True)
    print("SAME ORDER" if got == theirs else f"DIFFERENT: {got} != {theirs}", flush=True)
"""


def test_a_loader_stalled_past_job_gc_timeout_finishes_its_epoch(
        process_cluster: ProcessCluster) -> None:
    dispatcher = process_cluster.start_dispatcher("--job-gc-timeout-ms", "300")
    process_cluster.start_worker()
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, process_cluster.target, str(STALL_S)],
        capture_output=True, text=True, env=process_cluster.env, cwd=REPO, timeout=150)
    output = result.stdout + result.stderr
    assert "released" in dispatcher.output, "the stall did not outlive job_gc_timeout_ms"
    assert result.returncode == 0 and "SAME ORDER" in result.stdout, output
    assert "registered again" in output, output  # the warning

"""Torch fidelity, iterator life cycle: an epoch broken off and started again, two iterators of
one loader and persistent workers' epochs give torch's batches (torch draws each iter()'s
shuffle from the generator's state at that moment); a script that breaks out early or finishes
exits promptly and quietly."""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import torch_dataservice as tds
from tests.conftest import Cluster, subprocess_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


class Indices(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> int:
        return index


def both(cluster: Cluster, **kwargs: Any) -> tuple[Any, Any]:
    """torch's loader and ours, with the same arguments and equally seeded generators."""
    kwargs = dict(batch_size=3, shuffle=True, **kwargs)
    theirs = torch.utils.data.DataLoader(Indices(), generator=torch.Generator().manual_seed(6),
                                         **kwargs)
    ours = tds.DataLoader(Indices(), generator=torch.Generator().manual_seed(6),
                          service=cluster.target, **kwargs)
    return theirs, ours


def lists(batches: Any) -> list[list[int]]:
    return [batch.tolist() for batch in batches]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_breaking_out_and_iterating_again_as_with_torch(cluster: Cluster,
                                                        num_workers: int) -> None:
    def run(loader: Any) -> list[list[list[int]]]:
        first = lists(itertools.islice(iter(loader), 2))  # broken off after 2 batches
        return [first, lists(loader), lists(itertools.islice(iter(loader), 1)), lists(loader)]

    theirs, ours = both(cluster, num_workers=num_workers)
    assert run(ours) == run(theirs)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_two_iterators_of_one_loader_as_with_torch(cluster: Cluster, num_workers: int) -> None:
    def run(loader: Any) -> list[Any]:
        first, second = iter(loader), iter(loader)
        got = [next(second).tolist(), next(first).tolist()]
        got += [lists(first), lists(second)]
        return got

    theirs, ours = both(cluster, num_workers=num_workers)
    assert run(ours) == run(theirs)


def test_persistent_workers_epochs_as_with_torch(cluster: Cluster) -> None:
    theirs, ours = both(cluster, num_workers=2, persistent_workers=True)
    expected = [lists(theirs) for _ in range(3)]
    assert expected[0] != expected[1]
    assert [lists(ours) for _ in range(3)] == expected


SCRIPT = """
    import itertools, sys, time
    import torch
    import torch_dataservice as tds

    class Squares(torch.utils.data.Dataset):
        def __len__(self):
            return 64
        def __getitem__(self, i):
            return i * i

    loader = tds.DataLoader(Squares(), batch_size=4, shuffle=True, num_workers=2)
    for batch in loader:
        break                                    # broken off, iterator left behind
    held = iter(loader)
    next(held)                                   # an iterator still open at exit
    assert sum(len(b) for b in loader) == 64     # and one epoch read to the end
    print(time.time(), flush=True)
"""


def test_a_script_exits_promptly_and_quietly(tmp_path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = subprocess_env()
    env.pop("TORCH_DATASERVICE_ADDRESS", None)  # the embedded service
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            env=env, cwd=str(tmp_path), timeout=80)
    exited = time.time()
    assert result.returncode == 0, result.stderr[-3000:]
    assert exited - float(result.stdout.split()[-1]) < 5.0  # the end of the script to exit
    assert result.stderr.strip() == ""  # no traceback, no warning, no log line

"""Torch fidelity, the workers' copies of the dataset: worker_init_fn seeds a worker's first
batch as in torch, a worker_init_fn that is a method of the dataset configures the copy that
makes the batches, and what dataset code changes in its copy stays in that copy (a fresh one
per epoch, or per loader with persistent workers). torch's own result is computed in a fresh
interpreter (reference.py)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import torch_dataservice as tds
from tests.conftest import Cluster
from tests.torch.reference import torch_result

pytestmark = [pytest.mark.timeout(120), pytest.mark.integration]


class Draw(Dataset):
    """Sample i: the worker's torch seed and one draw of each RNG torch's workers seed."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> list:
        return [index, torch.initial_seed(), int(np.random.randint(1 << 30)), random.random(),
                float(torch.rand(()))]


def as_is(sample: Any) -> Any:
    return sample


def seeding_init(worker_id: int) -> None:
    """torch's documented way to control worker randomness: seed in worker_init_fn."""
    torch.manual_seed(12345 + worker_id)
    np.random.seed(1000 + worker_id)
    random.seed(77 + worker_id)


def drawing_init(worker_id: int) -> None:
    """Draws from each RNG: the worker's first batch continues after these draws."""
    torch.rand(worker_id + 1)
    np.random.rand(3)
    random.random()


DRAW_EPOCHS = """
    import json, torch
    from tests.torch.test_fidelity_copies import Draw, as_is, {init}
    loader = torch.utils.data.DataLoader(
        Draw(), batch_size=None, num_workers=2, collate_fn=as_is, worker_init_fn={init},
        generator=torch.Generator().manual_seed(5))
    print(json.dumps([list(loader) for _ in range(2)]))
"""


@pytest.mark.parametrize("init", ["seeding_init", "drawing_init"])
def test_a_workers_first_batch_starts_where_worker_init_fn_left_the_rngs(
        cluster: Cluster, init: str) -> None:
    theirs = torch_result(DRAW_EPOCHS.format(init=init))
    loader = tds.DataLoader(Draw(), batch_size=None, num_workers=2, collate_fn=as_is,
                            worker_init_fn=globals()[init], service=cluster.target,
                            generator=torch.Generator().manual_seed(5))
    ours = [[list(sample) for sample in loader] for _ in range(2)]
    for epoch in range(2):
        assert [s[0] for s in ours[epoch]] == [s[0] for s in theirs[epoch]]
        # Each worker's first batch (samples 0 and 1) is torch's, RNG draws and all.
        assert ours[epoch][:2] == theirs[epoch][:2], epoch
    if init == "seeding_init":
        assert [s[1] for s in ours[0][:2]] == [12345, 12346]


class ConfiguredByMethod(Dataset):
    """torch's TestIndividualWorkerQueue pattern: worker_init_fn is a method of the dataset
    and configures the worker's copy."""

    def __init__(self, n: int) -> None:
        self.n, self.worker_id = n, None

    def worker_init_fn(self, worker_id: int) -> None:
        self.worker_id = worker_id

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> list[int]:
        return [-1 if self.worker_id is None else self.worker_id, index]


class StreamConfiguredByMethod(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n, self.worker_id = n, None

    def worker_init_fn(self, worker_id: int) -> None:
        self.worker_id = worker_id

    def __iter__(self) -> Iterator[list[int]]:
        for index in range(self.n):
            yield [-1 if self.worker_id is None else self.worker_id, index]


METHOD_INIT = """
    import json, torch
    from tests.torch.test_fidelity_copies import {cls}
    dataset = {cls}(8)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers={workers},
                                         worker_init_fn=dataset.worker_init_fn)
    print(json.dumps([[t.tolist() for t in batch] for batch in loader]))
"""


@pytest.mark.parametrize("cls,workers", [("ConfiguredByMethod", 1),
                                         ("StreamConfiguredByMethod", 2)],
                         ids=["map-style", "iterable"])
def test_a_worker_init_fn_method_configures_the_copy_that_makes_the_batches(
        cluster: Cluster, cls: str, workers: int) -> None:
    theirs = torch_result(METHOD_INIT.format(cls=cls, workers=workers))
    dataset = globals()[cls](8)
    loader = tds.DataLoader(dataset, batch_size=4, num_workers=workers,
                            worker_init_fn=dataset.worker_init_fn, service=cluster.target)
    ours = [[t.tolist() for t in batch] for batch in loader]
    assert ours == theirs
    assert all(-1 not in ids for ids, _ in theirs)


class Calls(Dataset):
    """Counts the calls of __getitem__ made on its copy."""

    def __init__(self) -> None:
        self.calls = 0

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        self.calls += 1
        return self.calls


COPIES = """
    import json, torch
    from tests.torch.test_fidelity_copies import Calls
    def epoch(loader):
        return [batch.tolist() for batch in loader]
    def make():
        return torch.utils.data.DataLoader(Calls(), batch_size=2, num_workers=1,
                                           persistent_workers={persistent})
    first, second = make(), make()
    print(json.dumps([epoch(first) for _ in range(3)] + [epoch(second)]))
"""


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent"])
def test_what_dataset_code_changes_stays_in_its_epoch_and_loader(
        cluster: Cluster, persistent: bool) -> None:
    # One executor process makes every batch of a worker (num_workers=1), as torch's one
    # worker does, so the copies can be compared call by call.
    theirs = torch_result(COPIES.format(persistent=persistent))

    def make() -> tds.DataLoader:
        return tds.DataLoader(Calls(), batch_size=2, num_workers=1,
                              persistent_workers=persistent, service=cluster.target)

    first, second = make(), make()  # equal datasets: equal pickles
    ours = [[b.tolist() for b in first] for _ in range(3)] + [[b.tolist() for b in second]]
    assert ours == theirs
    # Non-persistent workers start every epoch from a fresh copy; persistent ones keep theirs,
    # and another loader never sees it.
    assert theirs[1] == ([[1, 2], [3, 4]] if not persistent else [[5, 6], [7, 8]])
    assert theirs[3] == [[1, 2], [3, 4]]

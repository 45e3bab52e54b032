"""Torch fidelity, randomness: random augmentation in dataset code is seeded as torch seeds its
workers (base seed from the loader's generator or the global RNG, drawn per iter(); worker
seed = base seed + worker id), so it is reproducible from torch.manual_seed, differs between
epochs, does not depend on which executor made a batch, and a resumed run draws the same."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import torch_dataservice as tds
from tests.conftest import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


class Augmented(Dataset):
    """Sample i with one draw of each RNG torch's workers seed."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> tuple:
        return index, float(torch.rand(())), random.random(), float(np.random.rand())


class AugmentedStream(IterableDataset):
    def __iter__(self) -> Iterator[tuple]:
        info = torch.utils.data.get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for index in range(start, 10, step):
            yield index, float(torch.rand(())), random.random(), float(np.random.rand())


def as_is(samples: Any) -> Any:
    return samples


def epochs(loader: Any, count: int = 2, seed: int | None = 7) -> list[list[tuple]]:
    if seed is not None:
        torch.manual_seed(seed)
    return [[tuple(float(x) for x in sample) for sample in loader] for _ in range(count)]


def test_augmentations_follow_the_global_seed_and_change_per_epoch(cluster: Cluster) -> None:
    kwargs = dict(batch_size=None, shuffle=True, num_workers=2, collate_fn=as_is)
    theirs_loader = torch.utils.data.DataLoader(Augmented(), **kwargs)
    ours_loader = tds.DataLoader(Augmented(), service=cluster.target, **kwargs)
    theirs, ours = epochs(theirs_loader), epochs(ours_loader)
    assert epochs(theirs_loader) == theirs and epochs(ours_loader) == ours  # reproducible
    assert theirs[0] != theirs[1] and ours[0] != ours[1]  # each epoch draws anew
    assert epochs(ours_loader, seed=8) != ours  # and follows the seed
    for e in range(2):
        # Same shuffle; each worker's first batch is seeded exactly as torch's worker.
        assert [s[0] for s in ours[e]] == [s[0] for s in theirs[e]]
        assert ours[e][:2] == theirs[e][:2]


def test_a_generator_seeds_the_workers_not_the_global_rng(cluster: Cluster) -> None:
    def run(loader_type: type, **extra: Any) -> list[list[tuple]]:
        loader = loader_type(Augmented(), batch_size=None, num_workers=2,
                             generator=torch.Generator().manual_seed(3), **extra)
        return epochs(loader, seed=None)

    torch.manual_seed(1)
    ours = run(tds.DataLoader, service=cluster.target)
    torch.manual_seed(2)  # the global RNG plays no part
    assert run(tds.DataLoader, service=cluster.target) == ours
    theirs = run(torch.utils.data.DataLoader)
    assert [e[:2] for e in ours] == [e[:2] for e in theirs]


def test_whichever_executor_makes_a_batch_it_is_augmented_alike(cluster: Cluster,
                                                                cluster_factory) -> None:
    fleet = cluster_factory(2, num_processes=0)  # other workers, other executors
    kwargs = dict(batch_size=2, shuffle=True, num_workers=2)
    results = []
    for service in (cluster.target, fleet.target):
        loader = tds.DataLoader(Augmented(), service=service,
                                generator=torch.Generator().manual_seed(4), **kwargs)
        results.append([[b.tolist() for b in batch] for batch in loader])
    assert results[0] == results[1]


def test_iterable_datasets_draw_torchs_augmentations(cluster: Cluster) -> None:
    kwargs = dict(batch_size=None, num_workers=2)
    theirs = epochs(torch.utils.data.DataLoader(AugmentedStream(), **kwargs))
    ours = epochs(tds.DataLoader(AugmentedStream(), service=cluster.target, **kwargs))
    assert ours == theirs  # every shard is torch's worker, RNG stream and all
    assert ours[0] != ours[1]


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh-workers", "persistent"])
def test_a_resumed_run_draws_the_same_augmentations(cluster: Cluster, persistent: bool) -> None:
    def make() -> tds.DataLoader:
        return tds.DataLoader(Augmented(), batch_size=2, shuffle=True, num_workers=2,
                              persistent_workers=persistent, service=cluster.target,
                              generator=torch.Generator().manual_seed(9))

    def batches(loader: Any, limit: int | None = None) -> list[list]:
        return [[t.tolist() for t in batch] for batch in itertools.islice(loader, limit)]

    whole = make()
    uninterrupted = [batches(whole) for _ in range(3)]
    assert uninterrupted[0] != uninterrupted[1] != uninterrupted[2]

    interrupted = make()
    batches(interrupted)
    head = batches(interrupted, limit=1)
    saved = json.loads(json.dumps(interrupted.state_dict()))
    restored = make()
    restored.load_state_dict(saved)
    assert head + batches(restored) == uninterrupted[1]
    assert batches(restored) == uninterrupted[2]

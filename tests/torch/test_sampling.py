"""Index planning on the trainer: torch's draw replayed exactly, seeded draws, rank splits."""

from __future__ import annotations

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler

from torch_dataservice.torch import sampling


class Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def torch_indices(loader: DataLoader) -> list:
    """What torch's own iterator draws (the identity dataset makes batches = indices)."""
    return [b.tolist() if isinstance(b, torch.Tensor) else b for b in loader]


def test_torch_order_is_torch_draw_across_epochs() -> None:
    ours = DataLoader(Sized(10), batch_size=3, shuffle=True,
                      generator=torch.Generator().manual_seed(5))
    theirs = DataLoader(Sized(10), batch_size=3, shuffle=True,
                        generator=torch.Generator().manual_seed(5))
    for _ in range(3):  # the generator continues from epoch to epoch as in torch
        assert sampling.torch_order(ours) == torch_indices(theirs)


def test_torch_order_with_global_rng_and_replay() -> None:
    ours = DataLoader(Sized(9), batch_size=None, shuffle=True)
    torch.manual_seed(1)
    snapshot = sampling.rng_snapshot(ours)
    drawn = sampling.torch_order(ours)
    torch.manual_seed(1)
    assert drawn == torch_indices(DataLoader(Sized(9), batch_size=None, shuffle=True))
    before = torch.get_rng_state()
    with sampling.replaying(ours, snapshot):
        assert sampling.torch_order(ours) == drawn
    assert torch.equal(torch.get_rng_state(), before)  # the caller's global RNG is untouched


def test_seeded_default_order_is_distributed_sampler_drop_last() -> None:
    data = Sized(23)
    for epoch in (0, 1):
        parts = []
        for rank in range(3):
            sampler = DistributedSampler(data, num_replicas=3, rank=rank, shuffle=True,
                                         seed=7, drop_last=True)
            sampler.set_epoch(epoch)
            ours = sampling.seeded_default_order(23, True, 7, epoch, rank, 3, even=True)
            assert ours == list(sampler)
            parts.append(ours)
        assert len({len(p) for p in parts}) == 1
        assert len(set().union(*map(set, parts))) == 21  # 23 - 23 % 3 dropped, no overlap
    uneven = [sampling.seeded_default_order(23, False, 0, 0, r, 3, even=False) for r in range(3)]
    assert sorted(sum(uneven, [])) == list(range(23))


def test_split_batches_deals_and_trims() -> None:
    batches = [[i] for i in range(7)]
    assert sampling.split_batches(batches, 1, 3, even=True) == [[1], [4]]
    assert sampling.split_batches(batches, 0, 3, even=False) == [[0], [3], [6]]
    assert sampling.batched(list(range(7)), 3, drop_last=True) == [[0, 1, 2], [3, 4, 5]]
    assert sampling.batched(list(range(7)), None, drop_last=False) == list(range(7))


def test_splits_by_rank_detects_distributed_sampler() -> None:
    data = Sized(8)
    sampler = DistributedSampler(data, num_replicas=2, rank=0)
    assert sampling.splits_by_rank(DataLoader(data, sampler=sampler))
    assert sampling.splits_by_rank(DataLoader(data, batch_sampler=BatchSampler(sampler, 2,
                                                                                False)))
    assert not sampling.splits_by_rank(DataLoader(data, sampler=RandomSampler(data)))

"""Which index batches one epoch yields on this rank.

Everything here runs on the trainer and only draws indices; the workers fetch them. Three ways
to draw an epoch:

- `torch_order`: exactly what torch's own DataLoader iterator draws from the same sampler and
  generator (one int64 for its base seed, then the index sampler), so a seeded generator gives
  torch's shuffle and consecutive epochs continue the generator as torch does.
- `seeded_default_order`: the default samplers as a function of (seed, epoch), the algorithm of
  `DistributedSampler` with `drop_last=True`: ranks agree without talking, `set_epoch`
  reshuffles, and a restarted process draws the same epoch again.
- `seeded_custom_order`: a user's sampler drawn under torch's global RNG seeded with
  seed + epoch (ranks agree when the sampler draws from the global RNG or is deterministic).

`seeded_default_order` with a rank and `split_batches` give one rank's part of a fresh epoch as
`dealing.Deal` deals it (the loader deals through `Deal` itself, also what remains of an epoch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from torch_dataservice.torch.dealing import DROP, UNEVEN, Deal

GLOBAL_RNG = "global"


def index_sampler(loader: torch.utils.data.DataLoader) -> Any:
    """The sampler whose items are fetched as one batch each (torch's `_index_sampler`)."""
    return loader.batch_sampler if loader.batch_sampler is not None else loader.sampler


def torch_order(loader: torch.utils.data.DataLoader) -> list[Any]:
    """The index batches torch's single-process iterator of `loader` would fetch, in order."""
    sampler_iter = iter(index_sampler(loader))
    # torch's _BaseDataLoaderIter draws its base seed between iter(sampler) and the first index.
    torch.empty((), dtype=torch.int64).random_(generator=loader.generator)
    return list(sampler_iter)


def seeded_default_order(num_items: int, shuffle: bool, seed: int, epoch: int, rank: int = 0,
                         world_size: int = 1, even: bool = True) -> list[int]:
    """This rank's sample indices: DistributedSampler(shuffle, seed, drop_last=even) at epoch.

    With `even`, at most world_size - 1 samples are dropped so every rank gets as many;
    without it every sample is kept and ranks may differ by one.
    """
    if shuffle:
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        order = torch.randperm(num_items, generator=generator).tolist()
    else:
        order = list(range(num_items))
    if world_size > 1:
        deal = Deal(num_items, world_size, DROP if even else UNEVEN)
        order = [order[p] for p in deal.positions(rank)]
    return order


def seeded_custom_order(loader: torch.utils.data.DataLoader, seed: int, epoch: int) -> list[Any]:
    """A user's (batch) sampler drawn with the global RNG seeded by seed + epoch, isolated."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + epoch)
        return list(iter(index_sampler(loader)))


def batched(order: list[Any], batch_size: int | None, drop_last: bool) -> list[Any]:
    """Group sample indices as BatchSampler does (`batch_size=None`: no batching)."""
    if batch_size is None:
        return order
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    if drop_last and batches and len(batches[-1]) < batch_size:
        batches.pop()
    return batches


def split_batches(batches: list[Any], rank: int, world_size: int, even: bool) -> list[Any]:
    """Rank `rank`'s batches: number b goes to rank b % world_size. With `even`, the last
    len % world_size batches (at most world_size - 1) are dropped so every rank gets as many.

    Consecutive batches go to different ranks of one step, so a length-bucketed batch sampler
    gives all ranks similar-sized batches in a step.
    """
    if world_size == 1:
        return batches
    deal = Deal(len(batches), world_size, DROP if even else UNEVEN)
    return [batches[p] for p in deal.positions(rank)]


def splits_by_rank(loader: torch.utils.data.DataLoader) -> bool:
    """Whether the user's sampler already gives each rank its own part (DistributedSampler)."""
    sampler = loader.sampler
    batch_sampler = loader.batch_sampler
    inner = getattr(batch_sampler, "sampler", None)
    return any(isinstance(s, DistributedSampler) for s in (sampler, batch_sampler, inner))


# ----------------------------------------------------------------------------- RNG state

def _generators(loader: torch.utils.data.DataLoader) -> dict[str, torch.Generator]:
    """The distinct torch.Generators the loader's samplers draw from, by where they sit."""
    batch_sampler = loader.batch_sampler
    candidates = {
        "generator": loader.generator,
        "sampler": getattr(loader.sampler, "generator", None),
        "batch_sampler": getattr(batch_sampler, "generator", None),
        "batch_sampler.sampler": getattr(getattr(batch_sampler, "sampler", None),
                                         "generator", None),
    }
    found: dict[str, torch.Generator] = {}
    seen: set[int] = set()
    for name, generator in candidates.items():
        if isinstance(generator, torch.Generator) and id(generator) not in seen:
            seen.add(id(generator))
            found[name] = generator
    return found


def rng_snapshot(loader: torch.utils.data.DataLoader) -> dict[str, torch.Tensor]:
    """The state of every RNG `torch_order(loader)` may draw from."""
    snapshot = {name: g.get_state() for name, g in _generators(loader).items()}
    snapshot[GLOBAL_RNG] = torch.get_rng_state()
    return snapshot


def restore(loader: torch.utils.data.DataLoader, snapshot: dict[str, torch.Tensor]) -> None:
    """Put the loader's generators and the global RNG back to `snapshot`."""
    for name, generator in _generators(loader).items():
        if name in snapshot:
            generator.set_state(snapshot[name])
    if GLOBAL_RNG in snapshot:
        torch.set_rng_state(snapshot[GLOBAL_RNG])


def global_rng_at(snapshot: dict[str, torch.Tensor]) -> bool:
    """Whether torch's global RNG is now in the state `snapshot` saved."""
    saved = snapshot.get(GLOBAL_RNG)
    return saved is not None and torch.equal(torch.get_rng_state(), saved)


@contextlib.contextmanager
def replaying(loader: torch.utils.data.DataLoader,
              snapshot: dict[str, torch.Tensor]) -> Iterator[None]:
    """Draw as from `snapshot`: the loader's generators are set to it (and so end where the
    original draw left them); the global RNG is only borrowed, the caller's is untouched."""
    for name, generator in _generators(loader).items():
        if name in snapshot:
            generator.set_state(snapshot[name])
    with torch.random.fork_rng(devices=[]):
        if GLOBAL_RNG in snapshot:
            torch.set_rng_state(snapshot[GLOBAL_RNG])
        yield

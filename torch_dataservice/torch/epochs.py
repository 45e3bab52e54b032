"""Epoch planning for `tds.DataLoader`: which epoch an `iter()` starts, what it is drawn from,
and the base seed of its workers.

torch's iterator, at `iter()`: `iter(index_sampler)`, then one int64 from the loader's
generator (or the global RNG) as the workers' base seed; the sampler itself draws at the first
`next()` with `num_workers=0`, at `iter()` with workers (they prefetch). Persistent workers
draw their base seed once, at the first `iter()`. We draw the same things at the same moments,
so two iterators of one loader, an epoch broken off and started again, and persistent
workers' epochs get torch's shuffles and seeds.

Seeded epochs (`set_epoch`, torchrun ranks) are a function of (seed, epoch) instead: ranks
agree without talking, and a restarted process draws the same epoch again. Their global order
is dealt out to the ranks by `dealing.Deal`; an epoch resumed from a global state
(global_state.py) deals only what no rank had yielded, at the current world size.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from torch_dataservice.torch import global_state, sampling
from torch_dataservice.torch.dealing import Deal
from torch_dataservice.torch.ranges import Range

logger = logging.getLogger(__name__)


def seeded_worker_seed(seed: int, epoch: int) -> int:
    """The workers' base seed of a seeded epoch: distinct per (seed, epoch), like torch's int64."""
    digest = hashlib.sha256(f"tds-worker-seed/{seed}/{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def draw_int64(generator: torch.Generator | None) -> int:
    """torch's base seed draw (`_BaseDataLoaderIter.__init__`)."""
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


@dataclass
class Epoch:
    """One `iter()`: its number, what is already yielded of it (a restored state), the RNG
    snapshot it was drawn from and the workers' base seed."""

    number: int
    yielded: int = 0
    positions: set[int] = field(default_factory=set)
    rng: dict | None = None
    worker_seed: int = 0
    round: int = 0
    batches: list[Any] | None = None
    #: Resumed from a global state: the positions of the global order already yielded, and
    #: the order's length then (checked against this draw's).
    consumed: list[Range] | None = None
    saved_length: int | None = None
    #: Seeded, dealt epochs: how the global order was dealt (what the state describes), and
    #: how many of its positions one batch holds (batch_size; 1 for a user's batches).
    deal: Deal | None = None
    per_batch: int = 1
    #: A resumed epoch: the batch its remainder starts at, per rank (for the batches' seeds:
    #: with ranks in step at the same world size, exactly the uninterrupted run's batches).
    first_batch: int = 0
    _sampler_iter: Any = None
    _replay: bool = False
    #: torch-exact epochs: a second iterator of the sampler, advanced as torch's iterator
    #: consumes indices, so the generators end each step where torch's would.
    _shadow: Any = None

    def advance(self, count: int = 1) -> None:
        """Consume `count` index batches as torch's iterator would (its RNG draws)."""
        shadow = self._shadow
        for _ in range(count if shadow is not None else 0):
            try:
                next(shadow)
            except StopIteration:
                self._shadow = None  # an exhausted sampler draws nothing more
                return


class EpochPlanner:
    """The loader's epochs: `begin()` at `iter()`, `draw()` of its batches, and what
    `state_dict()` needs to draw the same again."""

    def __init__(self, seed: int | None, seeded: bool, persistent: bool) -> None:
        self.seed = seed  # seeded epochs' seed (None: drawn at the first set_epoch)
        self.seeded = seeded
        self.persistent = persistent
        self.next_epoch = 0
        self.pending: dict[str, Any] | None = None  # a restored state, until iter()
        # Persistent workers: their base seed, drawn once, and how many epochs they served.
        self.worker_seed: int | None = None
        self.round = 0

    def set_epoch(self, epoch: int, loader: torch.utils.data.DataLoader) -> None:
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        if self.seed is None:
            self.seed = draw_int64(None)
        seen: set[int] = set()
        # Samplers that reshuffle per epoch (DistributedSampler), and datasets that do (an
        # iterable dataset's set_epoch): the dataset travels to the workers with each epoch.
        for target in (loader.sampler, loader.batch_sampler,
                       getattr(loader.batch_sampler, "sampler", None), loader.dataset):
            if target is not None and id(target) not in seen and hasattr(target, "set_epoch"):
                seen.add(id(target))
                target.set_epoch(epoch)
        pending = self.pending
        if pending is not None and pending["epoch"] != epoch:
            logger.warning("set_epoch(%d) discards the restored position in epoch %d",
                           epoch, pending["epoch"])
            self.pending = None
        self.next_epoch = epoch
        self.seeded = True

    def begin(self, loader: torch.utils.data.DataLoader, iterable: bool) -> Epoch:
        """Start the next epoch (or the restored one): draw what torch draws at `iter()`."""
        pending, self.pending = self.pending, None
        if pending is not None:
            epoch = self._restored(pending)
        else:
            epoch = Epoch(self.next_epoch)
        self.next_epoch = epoch.number + 1
        if self.seeded:
            assert self.seed is not None
            epoch.worker_seed = seeded_worker_seed(self.seed, epoch.number)
            return epoch
        if (epoch.rng is not None and epoch.yielded == 0 and not epoch.positions
                and sampling.global_rng_at(epoch.rng)):
            # A restored epoch from its start, and the global RNG is where it drew from (the
            # user restored it with the checkpoint, or it has not moved since the save): drawn
            # as a fresh epoch, so the global RNG advances as torch's and the next epoch
            # continues from there instead of drawing this one again.
            sampling.restore(loader, epoch.rng)
            epoch.rng = None
        if epoch.rng is None:
            epoch.rng = sampling.rng_snapshot(loader)
            self._draw_seeds(loader, epoch, iterable)
        else:  # restored: draw again from the saved RNG states
            epoch._replay = True
            with sampling.replaying(loader, epoch.rng):
                self._draw_seeds(loader, epoch, iterable)
        return epoch

    def _draw_seeds(self, loader: Any, epoch: Epoch, iterable: bool) -> None:
        if not iterable:
            epoch._sampler_iter = iter(sampling.index_sampler(loader))
        if self.persistent and self.worker_seed is not None:
            self.round += 1
        else:
            self.worker_seed = draw_int64(loader.generator)
            self.round = 0
        epoch.worker_seed, epoch.round = self.worker_seed, self.round
        if epoch._replay and not iterable:
            epoch.batches = list(epoch._sampler_iter)

    def _restored(self, state: dict[str, Any]) -> Epoch:
        if global_state.is_global(state):
            epoch = Epoch(int(state["epoch"]))
            if state["in_progress"]:
                epoch.consumed, epoch.saved_length = state["consumed_ranges"], state["length"]
            return epoch
        epoch = Epoch(int(state["epoch"]), rng=state["rng"])
        if state["in_progress"]:
            epoch.yielded = int(state["batches_yielded"])
            epoch.positions = set(state.get("positions") or ())
        if state.get("worker_seed") is not None:
            # The persistent workers' seed: the restored epoch draws it again only in round 0.
            self.worker_seed = int(state["worker_seed"])
            self.round = int(state.get("worker_round", 0))
            if state["in_progress"]:
                self.round -= 1
                if self.round < 0:
                    self.worker_seed, self.round = None, 0
        else:  # saved before any iter(): the restored epoch draws the workers' seed anew
            self.worker_seed, self.round = None, 0
        return epoch

    def draw(self, loader: Any, epoch: Epoch, rank: int, world: int, split: bool,
             policy: str, default_sampling: bool, shuffle: bool) -> list[Any]:
        """This rank's index batches of `epoch` (drawn once; torch-exact epochs draw from the
        generators' state at this moment)."""
        if epoch.batches is not None:
            return epoch.batches
        if not self.seeded:
            # The whole epoch is registered now, but torch's sampler draws as its iterator
            # goes (a broken-off epoch may not draw its end): draw all from here, put the
            # RNGs back, and let `Epoch.advance` draw again in torch's steps.
            snapshot = sampling.rng_snapshot(loader)
            epoch.batches = list(epoch._sampler_iter)
            sampling.restore(loader, snapshot)
            epoch._shadow = iter(sampling.index_sampler(loader))
            return epoch.batches
        assert self.seed is not None
        # The global order (samples, or a user's batches), the same on every rank.
        if default_sampling:
            order = sampling.seeded_default_order(len(loader.dataset), shuffle, self.seed,
                                                  epoch.number)
            epoch.per_batch = loader.batch_size or 1
        else:
            order = sampling.seeded_custom_order(loader, self.seed, epoch.number)
        global_state.check_length(epoch.saved_length, len(order), global_state.SAMPLES
                                  if default_sampling else global_state.BATCHES)
        rank, world = (rank, world) if split else (0, 1)
        epoch.deal = Deal(len(order), world, policy, tuple(epoch.consumed or ()))
        if world > 1 or epoch.consumed:
            order = [order[p] for p in epoch.deal.positions(rank)]
        if epoch.consumed:
            yielded = epoch.deal.length - epoch.deal.remaining
            epoch.first_batch = yielded // (world * epoch.per_batch)
        epoch.batches = (sampling.batched(order, loader.batch_size, loader.drop_last)
                         if default_sampling else order)
        return epoch.batches

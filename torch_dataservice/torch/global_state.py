"""A map-style loader's state for all ranks together, resumable at any world size.

Under torch.distributed, `state_dict()` is a collective: each rank tells the others how far it
got in the epoch (`RankView`: how many of its positions it yielded in order, and any yielded
past them out of order), every rank merges the views alike (`combine`) and returns the same
dict. It names the epoch's *global* positions yielded by some rank, as ranges of the epoch's
global order (a seeded permutation, or a user sampler's batches): with ranks in step that is
one range `[0, k)`, whatever the epoch's size. `load_state_dict` at any world size deals out
what remains (dealing.py), so no sample is lost or repeated; the following epochs are those
of an uninterrupted run, being functions of (seed, epoch).

The state follows what the trainer was given (`next()` returned it), not what the service
made ahead. The format (plain JSON-able data):

    {"epoch": 3, "in_progress": True, "base_seed": 1234, "seeded": True, "rng": None,
     "world_size": 2, "batches_yielded": 5, "unit": "samples", "length": 1001,
     "consumed_ranges": [[0, 160]]}

`consumed_ranges`: half-open `[start, end)` ranges of positions of the epoch's global order.
`unit` says what a position is ("samples" with the default samplers, "batches" with a user's
sampler or batch sampler, whose batches are dealt whole); `length` is the epoch's global
order length, so a state of another dataset is refused; `batches_yielded` is the most any rank
had yielded (the ranks' step in the epoch); `world_size` the size it was saved at (informative).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch_dataservice.torch import ranges
from torch_dataservice.torch.dealing import Deal
from torch_dataservice.torch.distributed import RankInfo, all_gather
from torch_dataservice.torch.ranges import Range

SAMPLES, BATCHES = "samples", "batches"
KEYS = ("epoch", "in_progress", "base_seed", "world_size", "batches_yielded", "unit", "length",
        "consumed_ranges")


def is_global(state: Any) -> bool:
    """Whether `state` is of this format (per-rank states have no 'consumed_ranges'; the
    split states of DYNAMIC iterables, iterable_state.py, name theirs 'consumed')."""
    return isinstance(state, Mapping) and "consumed_ranges" in state


@dataclass(frozen=True)
class RankView:
    """What one rank tells the others at `state_dict()`.

    phase: "idle" (its next epoch not started), "pending" (a loaded state not yet iterated),
    "running" or "done" (its part of `epoch` all yielded). `prefix`: how many of its
    positions it yielded in order from the start; `extras`: indices of its positions yielded
    past those (an out-of-order read)."""

    epoch: int
    phase: str
    prefix: int = 0
    extras: tuple[int, ...] = ()
    batches: int = 0


def running_view(epoch: int, yielded_batches: set[int], batches: int, entries: int,
                 per_batch: int) -> RankView:
    """A running rank's view from the positions (in its batch list) of the batches it yielded.
    Batch j holds its positions `j * per_batch` up to `entries`."""
    first_missing = 0
    while first_missing in yielded_batches:
        first_missing += 1
    extras = sorted(
        i for j in yielded_batches if j > first_missing
        for i in range(j * per_batch, min((j + 1) * per_batch, entries)))
    return RankView(epoch, "running", min(first_missing * per_batch, entries), tuple(extras),
                    batches)


def combine(views: list[RankView], deal: Deal | None) -> tuple[int, bool, list[Range], int]:
    """(epoch, in progress, consumed positions, batches yielded) from every rank's view, in rank
    order. `deal`: the running epoch's dealing (the same on every rank)."""
    phases = {view.phase for view in views}
    if "pending" in phases:
        raise ValueError(f"ranks disagree: some loaded a state not yet iterated and some did "
                         f"not ({_describe(views)})")
    if phases <= {"idle", "done"}:
        upcoming = {view.epoch + (view.phase == "done") for view in views}
        if len(upcoming) != 1:
            raise ValueError(f"ranks are at different epochs: {_describe(views)}")
        return upcoming.pop(), False, [], 0
    epochs = {view.epoch for view in views}
    if "idle" in phases or len(epochs) != 1:
        raise ValueError(f"ranks are at different epochs: {_describe(views)}")
    assert deal is not None
    world = len(views)
    prefixes = [deal.count(rank) if view.phase == "done" else view.prefix
                for rank, view in enumerate(views)]
    common = min(prefixes)
    # Rank r's i-th position is item r + world * i of the dealt sequence.
    indices: list[Range] = [(0, world * common)]
    for rank, view in enumerate(views):
        indices += [(rank + world * i, rank + world * i + 1)
                    for i in (*range(common, prefixes[rank]), *view.extras)]
    consumed = ranges.normalized([*deal.consumed,
                                  *deal.sequence_positions(ranges.normalized(indices))])
    return epochs.pop(), True, consumed, max(view.batches for view in views)


def _describe(views: list[RankView]) -> str:
    return ", ".join(f"rank {rank} {view.phase} in epoch {view.epoch}"
                     for rank, view in enumerate(views))


def encode(epoch: int, in_progress: bool, seed: int | None, world_size: int, batches: int,
           unit: str, length: int | None, consumed: list[Range]) -> dict[str, Any]:
    """The state dict (see the module docstring)."""
    return {"epoch": epoch, "in_progress": in_progress, "base_seed": seed, "seeded": True,
            "rng": None, "world_size": world_size, "batches_yielded": batches, "unit": unit,
            "length": length, "consumed_ranges": ranges.encode(consumed)}


def validated(state: Mapping[str, Any], unit: str, length: int | None) -> dict[str, Any]:
    """`state` checked against this loader (`length`: its epoch's, when known without drawing),
    with a ValueError naming what is wrong; 'consumed_ranges' decoded to ranges."""
    missing = [key for key in KEYS if key not in state]
    if missing:
        raise ValueError(f"not a tds.DataLoader global state: missing {missing}")
    for key in ("epoch", "batches_yielded", "world_size"):
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"state {key!r} must be an int >= 0, got {value!r}")
    seed = state["base_seed"]
    if isinstance(seed, bool) or not isinstance(seed, int):  # a drawn int64 may be negative
        raise ValueError(f"state 'base_seed' must be an int, got {seed!r}")
    if not isinstance(state["in_progress"], bool):
        raise ValueError(f"state 'in_progress' must be a bool, got {state['in_progress']!r}")
    if state["unit"] != unit:
        raise ValueError(
            f"state counts {state['unit']!r} but this loader deals {unit!r} (a state saved "
            "with the default samplers loads only into a loader with the default samplers, "
            "and one saved with a custom sampler into one with a custom sampler)")
    saved_length = state["length"]
    if saved_length is not None and (isinstance(saved_length, bool)
                                     or not isinstance(saved_length, int) or saved_length < 0):
        raise ValueError(f"state 'length' must be an int >= 0 or None, got {saved_length!r}")
    check_length(saved_length, length, unit)
    loaded = {key: state[key] for key in KEYS}
    loaded["consumed_ranges"] = ranges.decode(state["consumed_ranges"], saved_length or 0)
    if loaded["in_progress"] and saved_length is None:
        raise ValueError("state 'length' must be given for an epoch in progress")
    return loaded


def check_length(saved: int | None, current: int | None, unit: str) -> None:
    """A state resumes only an epoch of the same length (the same dataset and sampler)."""
    if saved is not None and current is not None and saved != current:
        raise ValueError(f"state of an epoch of {saved} {unit} cannot resume this loader, whose "
                         f"epoch has {current} {unit} (another dataset or sampler?)")


def rank_view(pending: Mapping[str, Any] | None, progress: Any, deal: Deal | None,
              per_batch: int, next_epoch: int, rank: int) -> RankView:
    """This rank's view: a loaded state not yet iterated, or how far the latest iterator
    (`progress`, loader_iter.Progress) got in the epoch dealt by `deal`."""
    if pending is not None:
        return RankView(int(pending["epoch"]), "pending")
    if progress is None:
        return RankView(next_epoch, "idle")
    if progress.finished:
        return RankView(progress.epoch, "done", batches=progress.yielded)
    assert deal is not None, "a seeded map-style epoch is dealt out at iter()"
    return running_view(progress.epoch, progress.positions, progress.yielded, deal.count(rank),
                        per_batch)


def gather(view: RankView, ranks: RankInfo) -> list[RankView]:
    """Every rank's view, in rank order: a collective under a process group (its waits end at
    the group's timeout); a process alone needs nobody."""
    if ranks.process_group:
        return all_gather(view)
    if ranks.world_size > 1 and view.phase == "running":
        raise RuntimeError(
            "state_dict() in an epoch resumed from a global state needs every rank's position: "
            "initialise torch.distributed (init_process_group) so that ranks can gather it")
    return [view]


def reencoded(loaded: Mapping[str, Any]) -> dict[str, Any]:
    """A loaded (validated) state as it was saved."""
    state = dict(loaded)
    state["consumed_ranges"] = ranges.encode(list(loaded["consumed_ranges"]))
    state.update(seeded=True, rng=None)
    return state

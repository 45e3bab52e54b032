"""This process's place in a torchrun / torch.distributed run, and what ranks agree on.

Map-style loaders need no communication to iterate: every rank draws the same global batch
list from the same seed and keeps its own part, so a loader built on one rank only (an
evaluation loader on rank 0) can never hang the others. Ranks talk only in collectives the user
calls on every rank: iterable datasets under a process group, once per loader (rank 0
broadcasts the name of the job all ranks share: `broadcast_token`), and `state_dict()`, which
gathers every rank's position (`all_gather`). Both run on gloo, whatever the training backend.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from dataclasses import dataclass

import torch.distributed as dist

_RUN_ENV = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RankInfo:
    rank: int = 0
    world_size: int = 1
    #: A torch.distributed process group is initialised (collectives are possible).
    process_group: bool = False

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def rank_info() -> RankInfo:
    """Rank and world size from the initialised process group, else from torchrun's env."""
    if dist.is_available() and dist.is_initialized():
        return RankInfo(dist.get_rank(), dist.get_world_size(), True)
    try:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        return RankInfo()
    if world_size > 1 and 0 <= rank < world_size:
        return RankInfo(rank, world_size, False)
    return RankInfo()


def run_seed() -> int:
    """A shuffle seed every rank of this run derives alike: from torchrun's run id and the
    rendezvous address, or 0 (DistributedSampler's default) outside torchrun."""
    parts = [os.environ.get(name, "") for name in _RUN_ENV]
    if not any(parts):
        return 0
    digest = hashlib.sha256("|".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2  # fits torch's int64 seeds with room


def local_world_size() -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def restart_count() -> int:
    """How many times torchrun restarted this group (`--max-restarts`), 0 outside torchrun."""
    try:
        return max(0, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    except ValueError:
        return 0


_token_group: list = []  # the gloo group objects travel over, created once


def _gloo_group() -> object:
    """The default group when it is gloo, else a gloo group of our own (made once: a collective
    too), so small objects travel on CPU whatever the training backend. Its waits end at the
    process group's timeout."""
    if not _token_group:
        _token_group.append(None if dist.get_backend() == "gloo"
                            else dist.new_group(backend="gloo"))
    return _token_group[0]


def broadcast_token() -> str:
    """A random token chosen by rank 0 and known to every rank (a collective: every rank of the
    process group must call it, in the same order)."""
    box = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0, group=_gloo_group())
    return str(box[0])


def all_gather(value: object) -> list:
    """Every rank's `value`, in rank order (a collective, as `broadcast_token`)."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value, group=_gloo_group())
    return gathered

"""How a job divides its input among workers, and which workers a reader reads: one place.

The dispatcher, the workers and the readers all speak these values (the proto carries them as
plain ints and strings); tf.data service's ShardingPolicy and target_workers.
"""

from __future__ import annotations

import enum


class ShardingPolicy(enum.IntEnum):
    """How a job's input is divided among workers (tf.data service's ShardingPolicy)."""

    OFF = 0
    DYNAMIC = 1
    FILE = 2
    DATA = 3
    FILE_OR_DATA = 4
    HINT = 5

    @property
    def is_static(self) -> bool:
        """Static policies shard by a fixed worker list (`worker_addresses`)."""
        return self in STATIC_POLICIES


STATIC_POLICIES = frozenset(
    {ShardingPolicy.FILE, ShardingPolicy.DATA, ShardingPolicy.FILE_OR_DATA, ShardingPolicy.HINT})


def policy_name(value: int) -> str:
    """The policy's name, or the number itself when it is not a policy (for messages)."""
    try:
        return ShardingPolicy(value).name
    except ValueError:
        return str(value)


class TargetWorkers(str, enum.Enum):
    """Which workers a reader reads: every worker, or only those in this process / host."""

    AUTO = "AUTO"
    ANY = "ANY"
    LOCAL = "LOCAL"


TARGET_WORKERS = tuple(t.value for t in TargetWorkers)

"""`tds.DataLoader.state_dict()`'s format: plain JSON-able data, as torchdata's.

RNG states (torch ByteTensors) travel as base64 strings, so a state survives `json.dumps` /
`json.loads` as well as `torch.save` / `torch.load`. Keys added since the first format are
optional, so older states still load. This is one rank's state; under torch.distributed a
map-style loader saves one for all ranks instead (global_state.py), told apart by its
'consumed_ranges' key.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import torch

REQUIRED_KEYS = ("epoch", "batches_yielded", "in_progress", "rng", "base_seed", "seeded",
                 "rank", "world_size")
OPTIONAL_KEYS = ("worker_seed", "worker_round", "positions")


def encode_rng(snapshot: Mapping[str, torch.Tensor] | None) -> dict[str, str] | None:
    if snapshot is None:
        return None
    return {name: base64.b64encode(state.numpy().tobytes()).decode("ascii")
            for name, state in snapshot.items()}


def decode_rng(data: Mapping[str, Any] | None) -> dict[str, torch.Tensor] | None:
    if data is None:
        return None
    if not isinstance(data, Mapping):
        raise ValueError(f"state 'rng' must be a dict or None, got {data!r:.80}")
    decoded = {}
    for name, value in data.items():
        if isinstance(value, torch.Tensor):  # a state of the first format
            decoded[name] = value
        else:
            raw = bytearray(base64.b64decode(value))
            decoded[name] = torch.frombuffer(raw, dtype=torch.uint8).clone()
    return decoded


def positions_of(positions: set[int], yielded: int) -> list[int] | None:
    """The positions yielded, when they are not simply the first `yielded` (out of order)."""
    if not positions or positions == set(range(yielded)):
        return None
    return sorted(positions)


def validated(state: Any) -> dict[str, Any]:
    """`state` checked as torchdata checks what it loads, with a ValueError naming the problem."""
    if not isinstance(state, Mapping):
        raise ValueError(f"a DataLoader state must be a dict, got {type(state).__name__}")
    missing = [key for key in REQUIRED_KEYS if key not in state]
    if missing:
        raise ValueError(f"not a tds.DataLoader state: missing {missing}")
    for key in ("epoch", "batches_yielded", "rank", "world_size"):
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"state {key!r} must be an int >= 0, got {value!r}")
    loaded = {key: state[key] for key in REQUIRED_KEYS}
    loaded.update({key: state.get(key) for key in OPTIONAL_KEYS})
    loaded["rng"] = decode_rng(state["rng"])
    return loaded

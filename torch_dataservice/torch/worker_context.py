"""Dataset code on a service worker runs as it would in one of torch's DataLoader workers.

Runs in the workers' executor processes (shipped inside the pipeline, by reference). torch's
worker loop seeds `random`, torch and numpy with `base_seed + worker_id` (numpy with
`_generate_state(base_seed, worker_id)`), sets the `WorkerInfo` that
`torch.utils.data.get_worker_info()` returns, and calls `worker_init_fn(worker_id)`.

Here one executor process serves many loaders, epochs and (as threads) tasks at once, so the
process-wide RNGs and `_worker_info` are set only for the duration of one call, under a
process-wide lock, and put back afterwards: what dataset code draws depends on the seed it was
given, never on which executor ran it or what ran there before. The lock also makes
`get_worker_info()` correct for code that bound torch's function before we ran.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils import worker as torch_worker

_lock = threading.RLock()
_MASK64 = (1 << 64) - 1
_ROUND_MIX = 0x9E3779B97F4A7C15  # golden-ratio increment: distinct epochs of persistent workers


def round_seed(base_seed: int, round_index: int) -> int:
    """The base seed of the `round_index`-th epoch of persistent workers (round 0: torch's)."""
    return (base_seed + round_index * _ROUND_MIX) & _MASK64


@dataclass
class RngStates:
    """The states of the three RNGs torch's workers seed: `random`, torch's CPU RNG, numpy."""

    python: Any
    torch_state: torch.Tensor
    numpy_state: Any

    @classmethod
    def current(cls) -> RngStates:
        return cls(random.getstate(), torch.get_rng_state(), np.random.get_state())

    @classmethod
    def seeded(cls, base_seed: int, worker_id: int) -> RngStates:
        """The states torch's worker `worker_id` starts from, for `base_seed`."""
        with _lock:
            saved = cls.current()
            seed = (base_seed + worker_id) & _MASK64
            random.seed(seed)
            torch.manual_seed(seed)
            np.random.seed(torch_worker._generate_state(base_seed, worker_id))
            made = cls.current()
            saved.install()
        return made

    def install(self) -> None:
        random.setstate(self.python)
        torch.set_rng_state(self.torch_state)
        np.random.set_state(self.numpy_state)


def worker_info(worker_id: int, num_workers: int, base_seed: int,
                dataset: Any) -> torch_worker.WorkerInfo:
    """torch's WorkerInfo of worker `worker_id` (its seed is `base_seed + worker_id`)."""
    return torch_worker.WorkerInfo(id=worker_id, num_workers=num_workers,
                                   seed=(base_seed + worker_id) & _MASK64, dataset=dataset)


@contextlib.contextmanager
def as_torch_worker(info: torch_worker.WorkerInfo | None, rng: RngStates) -> Iterator[None]:
    """Run the block with `info` as `get_worker_info()` and the RNGs in `rng`; afterwards `rng`
    holds where the block left them (so a stream can continue) and the process's own states
    and worker info are back."""
    with _lock:
        saved = RngStates.current()
        saved_info = torch_worker._worker_info
        rng.install()
        torch_worker._worker_info = info
        try:
            yield
        finally:
            rng.python, rng.torch_state, rng.numpy_state = (
                random.getstate(), torch.get_rng_state(), np.random.get_state())
            torch_worker._worker_info = saved_info
            saved.install()

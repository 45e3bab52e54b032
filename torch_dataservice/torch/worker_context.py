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

This runs once per batch, so it is kept cheap: a seeded state is installed by seeding (not made
first, saved and restored), torch's CPU generator is seeded directly (`torch.manual_seed` also
queues a lazy CUDA seed, formatting the whole call stack each time, about half a millisecond),
and torch's `default_collate` stacks into ordinary memory, or into the executor's own
segments (`plain_collate`, pipeline/collate.py).
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils import worker as torch_worker

from torch_dataservice.pipeline.collate import is_default, stacking_collate

_lock = threading.RLock()
_MASK64 = (1 << 64) - 1
_ROUND_MIX = 0x9E3779B97F4A7C15  # golden-ratio increment: distinct epochs of persistent workers


def round_seed(base_seed: int, round_index: int) -> int:
    """The base seed of the `round_index`-th epoch of persistent workers (round 0: torch's)."""
    return (base_seed + round_index * _ROUND_MIX) & _MASK64


def _accelerator_initialized() -> bool:
    """Some accelerator's RNG is live here (then torch.manual_seed seeds it at once)."""
    return any(getattr(getattr(torch, name, None), "is_initialized", lambda: False)()
               for name in ("cuda", "xpu"))


def seed_torch(seed: int) -> None:
    """`torch.manual_seed(seed)` for the CPU generator, the one state RngStates keeps; with no
    accelerator initialized it skips torch's lazy seeding of one (a formatted call stack)."""
    if _accelerator_initialized():
        torch.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


@dataclass
class RngStates:
    """The states of the three RNGs torch's workers seed: `random`, torch's CPU RNG, numpy;
    or, until first installed, the seeds that make them (`seeds`: installing seeds is cheaper
    than making the states and installing those)."""

    python: Any = None
    torch_state: torch.Tensor | None = None
    numpy_state: Any = None
    seeds: tuple[int, Any] | None = None  # (seed of random and torch, numpy's seed)

    @classmethod
    def current(cls) -> RngStates:
        return cls(random.getstate(), torch.get_rng_state(), np.random.get_state())

    @classmethod
    def seeded(cls, base_seed: int, worker_id: int) -> RngStates:
        """The states torch's worker `worker_id` starts from, for `base_seed`."""
        return cls(seeds=((base_seed + worker_id) & _MASK64,
                          torch_worker._generate_state(base_seed, worker_id)))

    def install(self) -> None:
        if self.seeds is not None:
            seed, numpy_seed = self.seeds
            random.seed(seed)
            seed_torch(seed)
            np.random.seed(numpy_seed)
            return
        random.setstate(self.python)
        torch.set_rng_state(self.torch_state)
        np.random.set_state(self.numpy_state)


def worker_info(worker_id: int, num_workers: int, base_seed: int,
                dataset: Any) -> torch_worker.WorkerInfo:
    """torch's WorkerInfo of worker `worker_id` (its seed is `base_seed + worker_id`)."""
    return torch_worker.WorkerInfo(id=worker_id, num_workers=num_workers,
                                   seed=(base_seed + worker_id) & _MASK64, dataset=dataset)


@contextlib.contextmanager
def as_torch_worker(info: torch_worker.WorkerInfo | None, rng: RngStates,
                    keep: bool = True) -> Iterator[None]:
    """Run the block with `info` as `get_worker_info()` and the RNGs in `rng`; afterwards, with
    `keep`, `rng` holds where the block left them (so a stream can continue), and the
    process's own states and worker info are back."""
    with _lock:
        saved = RngStates.current()
        saved_info = torch_worker._worker_info
        rng.install()
        torch_worker._worker_info = info
        try:
            yield
        finally:
            if keep:
                rng.python, rng.torch_state, rng.numpy_state = (
                    random.getstate(), torch.get_rng_state(), np.random.get_state())
                rng.seeds = None
            torch_worker._worker_info = saved_info
            saved.install()


def plain_collate(collate_fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """`collate_fn`, except that torch's `default_collate` runs as outside a worker.

    In a worker, `default_collate` stacks into a new shared-memory segment (torch's workers
    hand the batch to their main process that way): a file, a mapping and a page fault per
    page for every batch. A service worker encodes the batch into its own buffer anyway, so
    that segment is pure cost; the values are the same. In an executor process big stacks go
    into its own pooled segments instead (pipeline/collate.py), sent from there without a
    copy. Any other collate_fn runs as given
    (it may ask `get_worker_info()`).
    """
    if not is_default(collate_fn):
        return collate_fn

    def collate(batch: Any) -> Any:
        saved = torch_worker._worker_info
        torch_worker._worker_info = None
        try:
            return stacking_collate(batch)
        finally:
            torch_worker._worker_info = saved

    return collate

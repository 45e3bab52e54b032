"""torch's `default_collate`, stacking big batches into memory an executor sends as it is.

In a worker's executor process a big payload is copied into a shared-memory segment for the
front (worker/shm.py): for a batch of images that is a second 10 MB copy after the stack,
the executor's largest cost per byte. torch's own workers avoid it by stacking into shared
memory (`default_collate` with a `WorkerInfo` set); here the stack goes into one of the
executor's own pooled segments (`use_allocator`), and the encoded payload is written around
it there, so the batch is copied once, by the stack. Elsewhere (no allocator: a trainer's
process, an in-process executor) it is torch's `default_collate`, the values the same either
way.

A batch stacked into a segment is sent from that memory: as with torch's DataLoader, code
must not write into a batch after the pipeline yielded it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data._utils.collate import (
    collate,
    collate_tensor_fn,
    default_collate,
    default_collate_fn_map,
)

# bytes -> writable memory for them, or None (too small, or no room): set in executors.
_allocate: Callable[[int], np.ndarray | None] | None = None


def use_allocator(allocate: Callable[[int], np.ndarray | None] | None) -> None:
    """Stack big batches into memory from `allocate` in this process (None: plain memory)."""
    global _allocate
    _allocate = allocate


def stacking_collate(batch: Any) -> Any:
    """`default_collate(batch)`, with big tensor stacks in memory from the allocator."""
    if _allocate is None:
        return default_collate(batch)
    return collate(batch, collate_fn_map=_COLLATE_MAP)


def is_default(collate_fn: Callable[[Any], Any] | None) -> bool:
    """Whether `collate_fn` is torch's default (which `stacking_collate` stands in for)."""
    return collate_fn is None or collate_fn is default_collate or collate_fn is stacking_collate


def _stack(batch: Any, *, collate_fn_map: Any = None) -> torch.Tensor:
    elem = batch[0]
    allocate = _allocate
    if (allocate is not None and type(elem) is torch.Tensor and elem.layout == torch.strided
            and elem.device.type == "cpu" and not elem.is_quantized and not elem.is_nested
            and not any(t.requires_grad for t in batch)  # stack(out=) refuses autograd
            and all(type(t) is torch.Tensor and t.shape == elem.shape and t.dtype == elem.dtype
                    and t.device == elem.device for t in batch)):
        memory = allocate(len(batch) * elem.numel() * elem.element_size())
        if memory is not None:
            out = torch.from_numpy(memory).view(elem.dtype).view(len(batch), *elem.shape)
            return torch.stack(batch, 0, out=out)
    return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


_COLLATE_MAP: dict[Any, Callable[..., Any]] = {**default_collate_fn_map, torch.Tensor: _stack}

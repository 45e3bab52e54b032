"""What `even_batches` costs a tds.DataLoader per epoch, for `DataLoader.stats()`.

Under torch.distributed with `even_batches=True` (the only mode so far; "pad" is to come),
the epoch's global list is cut to a multiple of the world size: with the default samplers at
most world_size - 1 samples are dropped, with a user's sampler at most world_size - 1 batches.
"""

from __future__ import annotations

from typing import Any

from torch_dataservice.torch import sampling


def even_batches_loss(loader: Any) -> tuple[int, int]:
    """(samples dropped, batches dropped) per epoch, as seen from every rank."""
    ranks = loader._tds_ranks
    if not (loader._tds_split and loader._tds_registrar.even) or ranks.world_size <= 1:
        return 0, 0
    if loader._tds_default_sampling:
        return len(loader.dataset) % ranks.world_size, 0
    try:
        count = len(sampling.index_sampler(loader))
    except TypeError:  # a sampler without a length
        return 0, 0
    return 0, count % ranks.world_size

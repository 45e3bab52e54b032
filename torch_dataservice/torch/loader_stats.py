"""What `even_batches` costs a tds.DataLoader per epoch, for `DataLoader.stats()`.

Under torch.distributed an epoch's global order is dealt out to the ranks (dealing.py): with
"drop" (`True`) its end is cut to a multiple of the world size, with "pad" its first positions
are given again, with `False` neither. With the default samplers a position is a sample, with
a user's sampler a whole batch, so the figures are samples or batches accordingly (at most
world_size - 1 either way). A resumed epoch counts what its remainder lost or repeated.
"""

from __future__ import annotations

from torch_dataservice.observability.client import ClientStats
from torch_dataservice.torch.dealing import Deal


def record_even_batches(stats: ClientStats, deal: Deal | None, samples: bool) -> None:
    """Set the last epoch's dropped / padded figures (`deal` None: nothing was dealt out)."""
    dropped = deal.dropped if deal is not None else 0
    padded = deal.padded if deal is not None else 0
    stats.samples_dropped, stats.samples_padded = (dropped, padded) if samples else (0, 0)
    stats.batches_dropped, stats.batches_padded = (0, 0) if samples else (dropped, padded)

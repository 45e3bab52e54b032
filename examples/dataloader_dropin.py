"""The one-line change: torch's DataLoader -> tds.DataLoader.

    python examples/dataloader_dropin.py                              # embedded service
    TORCH_DATASERVICE_ADDRESS=HOST:PORT python examples/dataloader_dropin.py   # a fleet

Same arguments, same batches in the same order (a seeded generator gives torch's shuffle). The
work moves from local worker processes to the service's workers: with no service configured the
loader starts a dispatcher and a worker in this process, so the script runs on a laptop; setting
`TORCH_DATASERVICE_ADDRESS` (or passing `service="grpc://HOST:PORT"`) moves it to a fleet of CPU
hosts without touching the code.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from torch.utils.data import Dataset

import torch_dataservice as tds


class Images(Dataset):
    """Decoding and augmenting an image, simulated: a few ms of numpy work per sample."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        rng = np.random.default_rng(index)
        image = rng.standard_normal((3, 64, 64)).astype(np.float32)
        for _ in range(3):
            image = np.tanh(image * 1.1 + 0.1)
        return torch.from_numpy(image), index % 10


def main() -> None:
    dataset = Images()

    # Before:
    # loader = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True, num_workers=2,
    #                                      generator=torch.Generator().manual_seed(0))
    # After (the one-line change):
    loader = tds.DataLoader(dataset, batch_size=32, shuffle=True, num_workers=2,
                            generator=torch.Generator().manual_seed(0))

    reference = torch.utils.data.DataLoader(dataset, batch_size=32, shuffle=True,
                                            generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    count = 0
    for (images, labels), (ref_images, ref_labels) in zip(loader, reference, strict=True):
        assert torch.equal(images, ref_images) and torch.equal(labels, ref_labels)
        count += 1
    print(f"{count} batches identical to torch.utils.data.DataLoader's "
          f"({time.perf_counter() - start:.2f}s)")


if __name__ == "__main__":
    main()

"""ImageNet-style training fed by the service: JPEG decode and augmentation on CPU workers.

A folder of JPEGs (`--data DIR`, every `*.jpg` below it; the label is the parent folder's
index, as torchvision's ImageFolder gives it) is read by `tds.DataLoader` as a map-style
dataset: the sampler runs here, the workers decode and augment (examples/image_ops.py; the
draft-mode fast path unless `--plain`) and send batches of 64 uint8 images; the trainer
normalises them on its device and takes a step of a small CNN.

    python examples/train_imagenet.py --synthetic 512              # makes its own JPEGs
    python examples/train_imagenet.py --data /datasets/imagenet/train --epochs 90
    TORCH_DATASERVICE_ADDRESS=grpc://dispatcher:5000 python examples/train_imagenet.py --data ...

Without `TORCH_DATASERVICE_ADDRESS` (or `--service`) the loader starts a dispatcher and a
worker on this machine; with it, the CPU hosts of the fleet do the decoding.
"""

from __future__ import annotations

import argparse
import glob
import io
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import image_ops  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import torch_dataservice as tds  # noqa: E402

MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255


class ImageFiles(torch.utils.data.Dataset):
    """`(uint8 CHW 224x224, label)` per JPEG path, augmented as ImageNet training does."""

    def __init__(self, paths: list[str], labels: list[int], fast: bool = True) -> None:
        self.paths, self.labels, self.fast = paths, labels, fast

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        data = tds.read_bytes(self.paths[index])
        transform = image_ops.fast_train_transform if self.fast else image_ops.train_transform
        return transform(data), self.labels[index]


def image_folder(root: str) -> tuple[list[str], list[int]]:
    """Paths and labels as ImageFolder: the label is the sorted index of the parent folder."""
    paths = sorted(glob.glob(os.path.join(root, "**", "*.jpg"), recursive=True))
    if not paths:
        raise ValueError(f"no *.jpg below {root!r}")
    classes = {c: i for i, c in enumerate(sorted({os.path.dirname(p) for p in paths}))}
    return paths, [classes[os.path.dirname(p)] for p in paths]


def make_synthetic(root: str, count: int, classes: int = 10) -> None:
    """`count` photo-like JPEGs of ImageNet-like sizes in `classes` folders."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(count):
        w, h = int(rng.integers(300, 640)), int(rng.integers(240, 480))
        base = rng.integers(0, 256, (h // 40, w // 40, 3), dtype=np.uint8)
        image = Image.fromarray(base).resize((w, h), Image.BICUBIC)
        folder = os.path.join(root, f"class{i % classes:03d}")
        os.makedirs(folder, exist_ok=True)
        buf = io.BytesIO()
        image.save(buf, "JPEG", quality=90)
        with open(os.path.join(folder, f"{i:06d}.jpg"), "wb") as f:
            f.write(buf.getvalue())


def small_cnn(classes: int) -> nn.Module:
    def block(cin: int, cout: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False),
                             nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

    return nn.Sequential(block(3, 16), block(16, 32), block(32, 64), block(64, 64),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", help="a folder of JPEGs (ImageFolder layout)")
    parser.add_argument("--synthetic", type=int, default=0, help="make this many JPEGs instead")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2, help="num_workers, as torch's")
    parser.add_argument("--plain", action="store_true", help="full decode (no draft mode)")
    parser.add_argument("--service", default=None, help="grpc://HOST:PORT of a dispatcher")
    parser.add_argument("--max-steps", type=int, default=None, help="stop each epoch early")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        root = args.data
        if root is None:
            if not args.synthetic:
                parser.error("give --data DIR or --synthetic N")
            root = scratch
            make_synthetic(root, args.synthetic)
        paths, labels = image_folder(root)
        classes = max(labels) + 1
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = small_cnn(classes).to(device).to(memory_format=torch.channels_last)
        optimiser = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loader = tds.DataLoader(
            ImageFiles(paths, labels, fast=not args.plain), batch_size=args.batch_size,
            shuffle=True, num_workers=args.workers, drop_last=True,
            pin_memory=device.type == "cuda", service=args.service)
        mean, std = MEAN.to(device), STD.to(device)
        for epoch in range(args.epochs):
            start, seen, waited = time.perf_counter(), 0, 0.0
            batches = iter(loader)
            for step in range(len(loader)):
                t = time.perf_counter()
                images, targets = next(batches)
                waited += time.perf_counter() - t
                images = images.to(device, non_blocking=True).float().sub_(mean).div_(std)
                targets = targets.to(device, non_blocking=True)
                loss = nn.functional.cross_entropy(
                    model(images.contiguous(memory_format=torch.channels_last)), targets)
                optimiser.zero_grad(set_to_none=True)
                loss.backward()
                optimiser.step()
                seen += len(images)
                if args.max_steps is not None and step + 1 >= args.max_steps:
                    break
            del batches
            elapsed = time.perf_counter() - start
            print(f"epoch {epoch}: {seen} images, {seen / elapsed:.0f} images/s, loss "
                  f"{loss.item():.3f}, waited for data {100 * waited / elapsed:.0f}% of the time",
                  flush=True)


if __name__ == "__main__":
    main()

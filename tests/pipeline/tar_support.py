"""Writing tar shards in the WebDataset layout for tests, and the samples they hold."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Mapping


def shard_bytes(samples: Mapping[str, Mapping[str, bytes]],
                tar_format: int = tarfile.PAX_FORMAT) -> bytes:
    """A tar archive with one member KEY.EXT per sample field, sample after sample."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tar_format) as tar:
        for key, fields in samples.items():
            for ext, data in fields.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def numbered_samples(shard: int, count: int, image_bytes: int = 100) -> dict[str, dict]:
    """`count` samples keyed s{shard}/{i}: a "jpg" of `image_bytes` and a "cls"."""
    return {f"s{shard:03d}/{i:05d}": {"jpg": bytes([i % 256]) * image_bytes,
                                       "cls": str(i).encode()}
            for i in range(count)}

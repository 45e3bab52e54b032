"""A torchrun trainer on a fleet host: each rank reads its share of (a) a DYNAMIC epoch of a
Pipeline, joined by job name, and (b) a map-style `tds.DataLoader`, and writes what it got
to OUT/rank{R}.json, so the test can check "exactly once across ranks" from outside.

    torchrun --nproc_per_node=2 tests/fleet/trainer.py SERVICE OUT --samples N
        [--modes pipeline,loader] [--job NAME]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import torch_dataservice as tds


class Vectors(Dataset):
    """Sample i is a 256-float vector of i's (1 KiB): enough bytes to see on the wire."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        # A little work per sample: the epoch lasts longer than one worker's lag behind the
        # other on a loaded host, so both serve some of it (tests/fleet/test_fleet.py checks).
        time.sleep(0.005)
        return {"index": index, "x": torch.full((256,), float(index))}


def slowly(x: int) -> int:
    """A little work per element, so that both ranks are still reading when the other joins."""
    time.sleep(0.002)
    return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("service")
    parser.add_argument("out", type=Path)
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--modes", default="pipeline,loader")
    parser.add_argument("--job", default="fleet")
    args = parser.parse_args()
    modes = args.modes.split(",")

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    record: dict = {"rank": rank, "world_size": dist.get_world_size()}
    if "pipeline" in modes:
        pipeline = tds.Pipeline.range(args.samples).map(slowly).apply(tds.distribute(
            "distributed_epoch", args.service, job_name=f"{args.job}-dynamic"))
        dist.barrier()  # both ranks join the job together
        record["pipeline"] = [int(x) for x in pipeline]
    if "loader" in modes:
        loader = tds.DataLoader(Vectors(args.samples), batch_size=8, shuffle=True,
                                generator=torch.Generator().manual_seed(7),
                                service=args.service)
        indices = []
        for batch in loader:
            assert torch.equal(batch["x"][:, 0], batch["index"].float()), "sample mixed up"
            indices += batch["index"].tolist()
        record["loader"] = indices
        record["loader_stats"] = loader.stats()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""A DDP training loop for tests/torch/test_resume_torchrun.py (run under torchrun, gloo, CPU).

It records every batch it is given (one JSON line per batch, flushed, so a SIGKILL loses
nothing recorded), can save `{"model", "optimizer", "loader"}` after `--save-at` steps and then
go on slowly until it is killed, and resumes from such a checkpoint at whatever world size it is
started with. A sleep per step makes it slower than the service (which runs ahead).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

import torch_dataservice as tds

SEED = 1234
HOLD_S = 60.0  # after the save: how long to go on before giving up on being killed


class Samples(Dataset):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        x = torch.full((4,), float(index))
        return {"index": index, "x": x, "y": x.sum(dim=0, keepdim=True)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--service", required=True)
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--record", type=Path, required=True, help="DIR/TAG: where to record")
    parser.add_argument("--save-at", type=int, default=None,
                        help="save after this many steps, then go on slowly until killed")
    parser.add_argument("--step-seconds", type=float, default=0.0)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    # Deep prefetch and two workers' worth of batches in flight: the service runs ahead.
    loader = tds.DataLoader(Samples(args.samples), batch_size=args.batch_size, shuffle=True,
                            generator=torch.Generator().manual_seed(SEED), num_workers=2,
                            prefetch_factor=8, service=args.service)
    start_epoch = 0
    if args.checkpoint.exists():
        saved = torch.load(args.checkpoint, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        loader.load_state_dict(saved["loader"])  # saved at another world size
        start_epoch = saved["loader"]["epoch"]

    args.record.parent.mkdir(parents=True, exist_ok=True)
    record = open(f"{args.record}.rank{rank}.jsonl", "a")  # noqa: SIM115 - closed at exit
    record.write(json.dumps({"pid": os.getpid(), "world": world, "t": time.time()}) + "\n")
    record.flush()
    steps = 0
    held_since = None
    for epoch in range(start_epoch, args.epochs):
        loader.set_epoch(epoch)  # keeps a restored position in this same epoch
        record.write(json.dumps({"epoch": epoch, "len": len(loader), "t": time.time()}) + "\n")
        for batch in loader:
            optimizer.zero_grad()
            nn.functional.mse_loss(model(batch["x"]), batch["y"]).backward()
            optimizer.step()
            steps += 1
            record.write(json.dumps({"epoch": epoch, "step": steps, "t": time.time(),
                                     "indices": batch["index"].tolist()}) + "\n")
            record.flush()
            if steps == args.save_at:
                state = loader.state_dict()  # a collective: every rank, at the same step
                if rank == 0:
                    partial = args.checkpoint.with_suffix(".partial")
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                "loader": state, "stats": loader.stats()}, partial)
                    os.replace(partial, args.checkpoint)
                held_since = time.monotonic()
            time.sleep(args.step_seconds)
            if held_since is not None and time.monotonic() - held_since > HOLD_S:
                raise SystemExit("not killed after the save")
    record.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Train a small model with DistributedDataParallel on data prepared by the service.

    # a service shared by all ranks (start it with `torch-dataservice dispatcher` + `worker`):
    torchrun --nproc_per_node=2 examples/train_ddp.py --service grpc://HOST:PORT
    # or nothing to set up: every rank starts a dispatcher and a worker of its own
    torchrun --nproc_per_node=2 examples/train_ddp.py

The only data-loading line is `tds.DataLoader(...)`, with torch's arguments. Under torchrun it
gives every rank a disjoint part of each epoch and the same number of batches (no hang at the
end of an epoch even though 1001 samples do not divide by 2 ranks x 16), `set_epoch`
reshuffles, and `state_dict()` goes into the checkpoint so a restarted run resumes mid-epoch,
with as many ranks or another number of them (the state is the same on every rank).
The dataset class below is defined in this script: it travels to the workers by value.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

import torch_dataservice as tds


class Regression(Dataset):
    """y = x . w + noise, generated from the index (a stand-in for decoding a sample)."""

    def __init__(self, size: int, features: int = 16) -> None:
        self.size = size
        self.features = features

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        g = torch.Generator().manual_seed(index)
        x = torch.randn(self.features, generator=g)
        y = x.sum(dim=0, keepdim=True) * 0.1 + 0.01 * torch.randn(1, generator=g)
        return {"index": index, "x": x, "y": y}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--service", default=None,
                        help="grpc://HOST:PORT of a dispatcher (default: "
                             "$TORCH_DATASERVICE_ADDRESS, else one started in each rank)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=1001)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="save the model and the loader's state in this directory after "
                             "each epoch (and at --max-steps); resume from it if it exists")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="stop after this many steps, as if preempted (with --checkpoint: "
                             "the next run resumes mid-epoch)")
    parser.add_argument("--record", type=Path, default=None,
                        help="append the sample indices each rank saw to DIR/rank{R}.json")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

    loader = tds.DataLoader(Regression(args.samples), batch_size=args.batch_size, shuffle=True,
                            generator=torch.Generator().manual_seed(1234),
                            service=args.service)
    start_epoch = 0
    if args.checkpoint is not None and args.checkpoint.exists():
        saved = torch.load(args.checkpoint / f"rank{rank}.pt", weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        loader.load_state_dict(saved["loader"])  # the same state for all ranks
        start_epoch = saved["loader"]["epoch"]

    def save() -> None:
        args.checkpoint.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "loader": loader.state_dict()},  # a collective: every rank calls it
                   args.checkpoint / f"rank{rank}.pt")

    seen: dict[int, list[list[int]]] = {}
    steps = 0
    for epoch in range(start_epoch, args.epochs):
        loader.set_epoch(epoch)  # keeps a restored mid-epoch position of this same epoch
        indices = seen.setdefault(epoch, [])
        total = 0.0
        for batch in loader:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(batch["x"]), batch["y"])
            loss.backward()  # all-reduce across ranks: every rank must take the same steps
            optimizer.step()
            total += loss.item()
            indices.append(batch["index"].tolist())
            steps += 1
            if steps == args.max_steps:
                break
        print(f"rank {rank}/{world_size} epoch {epoch}: {len(indices)} batches, "
              f"mean loss {total / max(1, len(indices)):.4f}", flush=True)
        if args.checkpoint is not None:
            save()
        if steps == args.max_steps:
            break

    if args.record is not None:
        args.record.mkdir(parents=True, exist_ok=True)
        path = args.record / f"rank{rank}.json"
        runs = json.loads(path.read_text()) if path.exists() else []
        runs.append({"rank": rank, "world_size": world_size, "pid": os.getpid(),
                     "epochs": {str(e): batches for e, batches in seen.items()}})
        path.write_text(json.dumps(runs))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

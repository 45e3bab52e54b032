"""Run under torchrun by tests/torch/test_torchrun_pipeline.py: training (gradients all-reduced
as DDP does, without its setup cost) on a DYNAMIC Pipeline.

A fresh run trains `--save-at` steps, saves `{"model", "loader": loader.state_dict()}` (a
collective: every rank saves the same loader state), trains a few steps more (data the
checkpoint must not count) and waits to be SIGKILLed. A run given `--resume` loads the
checkpoint (at any world size) and reads the rest of the epoch. Each rank appends one JSON
line per batch to DIR/rank{R}.jsonl: {"phase": "before"|"after-save"|"resumed", "samples"}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import torch_dataservice as tds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--service", required=True)
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--split-size", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    probe = torch.zeros(1)
    dist.all_reduce(probe)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    pipeline = tds.Pipeline.range(args.samples).with_split_size(args.split_size)
    loader = tds.DataLoader(pipeline, batch_size=args.batch_size, service=args.service)
    checkpoint = args.dir / "checkpoint.pt"
    phase = "before"
    if args.resume:
        saved = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(saved["model"])
        loader.load_state_dict(saved["loader"])
        phase = "resumed"
    record = (args.dir / f"rank{rank}.jsonl").open("a")
    steps = 0
    for batch in loader:
        loss = model(batch.float().unsqueeze(1)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        for parameter in model.parameters():  # DDP's all-reduce: every rank takes each step
            dist.all_reduce(parameter.grad)
        optimizer.step()
        record.write(json.dumps({"phase": phase, "samples": batch.tolist()}) + "\n")
        record.flush()
        steps += 1
        if not args.resume and steps == args.save_at:
            state = {"model": model.state_dict(), "loader": loader.state_dict()}
            if rank == 0:
                torch.save(state, args.dir / "checkpoint.tmp")
                (args.dir / "checkpoint.tmp").rename(checkpoint)
            phase = "after-save"
        if not args.resume and steps == args.save_at + 2:
            (args.dir / f"ready{rank}").touch()
            time.sleep(600)  # the test kills the whole process group
    record.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Run under torchrun by tests/torch/test_torchrun_pipeline.py: training (gradients all-reduced
as DDP does, without its setup cost) on a DYNAMIC Pipeline, for `--epochs` epochs.

Without a checkpoint the run trains `--save-at` steps, saves `{"model", "loader":
loader.state_dict()}` (a collective: every rank saves the same loader state) and trains on (data
the checkpoint must not count); in torchrun's first attempt (TORCHELASTIC_RESTART_COUNT 0) its
last rank then dies on its own after `--die-after` more steps, as a rank killed by the OOM
killer would, and torchrun (`--max-restarts`) restarts the group. A run that finds the
checkpoint (the restarted group, or a later run at any world size) loads it and reads the rest
of that epoch, then the next ones. Each rank appends one JSON line per batch to
DIR/rank{R}.jsonl, flushed (a rank that dies loses nothing it recorded):
{"attempt", "epoch", "phase": "before"|"after-save"|"resumed", "samples"}.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import torch_dataservice as tds


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--service", required=True)
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--split-size", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--die-after", type=int, default=2)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--dir", type=Path, required=True, help="where to record the batches")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(0)
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    pipeline = tds.Pipeline.range(args.samples).with_split_size(args.split_size)
    loader = tds.DataLoader(pipeline, batch_size=args.batch_size, service=args.service)
    checkpoint = args.checkpoint
    phase, start_epoch, save_at = "before", 0, args.save_at
    if checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(saved["model"])
        loader.load_state_dict(saved["loader"])  # saved at another world size, or the same
        phase, start_epoch, save_at = "resumed", saved["loader"]["epoch"], 0
    args.dir.mkdir(parents=True, exist_ok=True)
    record = (args.dir / f"rank{rank}.jsonl").open("a")
    steps = 0
    for epoch in range(start_epoch, args.epochs):
        loader.set_epoch(epoch)  # keeps a loaded position in this same epoch
        for batch in loader:
            loss = model(batch.float().unsqueeze(1)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            for parameter in model.parameters():  # DDP's all-reduce: every rank takes each step
                dist.all_reduce(parameter.grad)
            optimizer.step()
            record.write(json.dumps({"attempt": attempt, "epoch": epoch, "phase": phase,
                                     "samples": batch.tolist()}) + "\n")
            record.flush()
            steps += 1
            if steps == save_at:
                state = {"model": model.state_dict(), "loader": loader.state_dict()}
                if rank == 0:
                    partial = checkpoint.with_suffix(".partial")
                    torch.save(state, partial)
                    partial.rename(checkpoint)
                phase = "after-save"
            if save_at and attempt == 0 and rank == world - 1 \
                    and steps == save_at + args.die_after:
                os._exit(1)  # dies on its own; torchrun stops the other ranks and restarts
    record.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""PyTorch integration: `tds.DataLoader`, a drop-in for `torch.utils.data.DataLoader` whose
batches are made by the service's workers.

- `dataloader`: the loader: torch's arguments, iter(), len(), state_dict.
- `epochs`: which epoch an iter() starts, what it draws from, the workers' base seed.
- `sampling`: which index batches an epoch yields on this rank, replayed from torch's samplers.
- `registration`: registering an epoch with the service, and its job name.
- `loader_iter`: the iterator of one epoch and its readers (reorder, shard merge, timeout).
- `state`: the state_dict format (plain JSON-able data).
- `global_state`, `dealing`, `ranges`: under torch.distributed, one state for all ranks (the
  epoch's global positions yielded, as ranges), and how an epoch or what remains of it is
  dealt out to the ranks at any world size with the `even_batches` policy.
- `fetch`, `shards`, `worker_context` (run on the workers): one index batch made as torch's
  worker would (WorkerInfo, seeds, worker_init_fn); an iterable dataset's shard.
- `distributed`: the rank / world size of this process and what ranks agree on without talking.
- `embedded`: the dispatcher and worker started in this process when no service is given.
"""

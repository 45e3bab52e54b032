"""PyTorch integration: `tds.DataLoader`, a drop-in for `torch.utils.data.DataLoader` whose
batches are made by the service's workers.

- `dataloader`: the loader and its iterator (reorder buffer, timeout, pin_memory, resume).
- `sampling`: which index batches an epoch yields on this rank, replayed from torch's samplers.
- `fetch`: what a worker runs for one index batch (torch's own map-style fetch + collate).
- `distributed`: the rank / world size of this process and what ranks agree on without talking.
- `embedded`: the dispatcher and worker started in this process when no service is given.
"""

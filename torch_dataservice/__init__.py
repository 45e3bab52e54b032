"""torch_dataservice: tf.data service for PyTorch.

Move input pipelines off the training host: a dispatcher keeps track of pipelines, workers
and jobs; workers run the pipelines on CPU hosts and stream elements to the trainers.

Names are imported on first use, so `torch-dataservice dispatcher` starts without importing
torch (the dispatcher never runs user code).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"  # = version.PACKAGE_VERSION and pyproject.toml (tests/test_version.py)

_EXPORTS = {
    "CachedDataset": "torch_dataservice.pipeline.cache",
    "CrossTrainerCache": "torch_dataservice.client.api",
    "ShardingPolicy": "torch_dataservice.policies",
    "distribute": "torch_dataservice.client.api",
    "from_dataset_id": "torch_dataservice.client.api",
    "register_dataset": "torch_dataservice.client.api",
    "DispatcherConfig": "torch_dataservice.config",
    "WorkerConfig": "torch_dataservice.config",
    "TLSConfig": "torch_dataservice.config",
    "DispatchServer": "torch_dataservice.dispatcher.server",
    "RemoteError": "torch_dataservice.errors",
    "VersionMismatchError": "torch_dataservice.errors",
    "SHARD_HINT": "torch_dataservice.pipeline",
    "Pipeline": "torch_dataservice.pipeline",
    "read_bytes": "torch_dataservice.pipeline.storage",
    "WorkerServer": "torch_dataservice.worker.server",
    "DataLoader": "torch_dataservice.torch.dataloader",
}

__all__ = [
    "SHARD_HINT",
    "CachedDataset",
    "CrossTrainerCache",
    "DataLoader",
    "DispatchServer",
    "DispatcherConfig",
    "Pipeline",
    "RemoteError",
    "ShardingPolicy",
    "TLSConfig",
    "VersionMismatchError",
    "WorkerConfig",
    "WorkerServer",
    "distribute",
    "from_dataset_id",
    "read_bytes",
    "register_dataset",
]

if TYPE_CHECKING:
    from torch_dataservice.client.api import (
        CrossTrainerCache,
        ShardingPolicy,
        distribute,
        from_dataset_id,
        register_dataset,
    )
    from torch_dataservice.config import DispatcherConfig, TLSConfig, WorkerConfig
    from torch_dataservice.dispatcher.server import DispatchServer
    from torch_dataservice.errors import RemoteError, VersionMismatchError
    from torch_dataservice.pipeline import SHARD_HINT, Pipeline
    from torch_dataservice.pipeline.cache import CachedDataset
    from torch_dataservice.pipeline.storage import read_bytes
    from torch_dataservice.torch.dataloader import DataLoader
    from torch_dataservice.worker.server import WorkerServer


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'torch_dataservice' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])

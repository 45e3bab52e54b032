"""torch_dataservice: tf.data service for PyTorch.

Move input pipelines off the training host: a dispatcher keeps track of pipelines, workers
and jobs; workers run the pipelines on CPU hosts and stream elements to the trainers.
"""

from torch_dataservice.client.api import (
    CrossTrainerCache,
    ShardingPolicy,
    distribute,
    from_dataset_id,
    register_dataset,
)
from torch_dataservice.config import DispatcherConfig, WorkerConfig
from torch_dataservice.dispatcher.server import DispatchServer
from torch_dataservice.errors import RemoteError
from torch_dataservice.pipeline import SHARD_HINT, Pipeline
from torch_dataservice.worker.server import WorkerServer

__version__ = "0.1.0"

__all__ = [
    "SHARD_HINT",
    "CrossTrainerCache",
    "DispatchServer",
    "DispatcherConfig",
    "Pipeline",
    "RemoteError",
    "ShardingPolicy",
    "WorkerConfig",
    "WorkerServer",
    "distribute",
    "from_dataset_id",
    "register_dataset",
]


def __getattr__(name: str):  # the DataLoader imports torch.distributed: load it on first use
    if name == "DataLoader":
        from torch_dataservice.torch.dataloader import DataLoader

        return DataLoader
    raise AttributeError(f"module 'torch_dataservice' has no attribute {name!r}")

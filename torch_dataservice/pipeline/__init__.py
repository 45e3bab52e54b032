"""Lazily described input pipelines, their local execution, split-driven sources and the static
sharding rewrites the service applies to them."""

from torch_dataservice.pipeline.context import ExecutionContext, SplitProvider
from torch_dataservice.pipeline.core import Pipeline
from torch_dataservice.pipeline.sharding import SHARD_HINT

__all__ = ["SHARD_HINT", "ExecutionContext", "Pipeline", "SplitProvider"]

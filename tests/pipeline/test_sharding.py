"""Static sharding rewrites (FILE / DATA / HINT), the SHARD_HINT placeholder, and the plan of
replicas a worker runs for a task."""

from __future__ import annotations

import pickle

import cloudpickle
import pytest

from torch_dataservice.pipeline import SHARD_HINT, Pipeline
from torch_dataservice.pipeline.sharding import (
    ReplicaPlan,
    Rewrite,
    RewriteKind,
    Shard,
    plan_replicas,
    resolve_shard_hints,
    shard_data,
    shard_files,
    shard_slice,
)
from torch_dataservice.policies import ShardingPolicy
from torch_dataservice.proto import common_pb2

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def ten_files(tmp_path) -> Pipeline:
    for i in range(10):
        (tmp_path / f"{i}.txt").write_text(str(i))
    return Pipeline.list_files(str(tmp_path / "*.txt"))


def test_shard_slice_is_the_one_arithmetic() -> None:
    assert list(range(10))[shard_slice(3, 2)] == [2, 5, 8]
    with pytest.raises(ValueError, match="got 3"):
        shard_slice(3, 3)


def test_shard_files_keeps_every_nth_file(ten_files: Pipeline) -> None:
    pipeline = ten_files.map(lambda path: open(path).read())
    shards = [shard_files(pipeline, 3, i) for i in range(3)]
    for i, shard in enumerate(shards):
        assert shard.files == ten_files.files[i::3]
        assert list(shard) == [str(k) for k in range(10)[i::3]]
    assert sorted(f for s in shards for f in s.files) == sorted(ten_files.files)
    assert pipeline.files == ten_files.files  # the original is untouched


def test_shard_files_needs_enough_files_and_a_file_source(ten_files: Pipeline) -> None:
    with pytest.raises(ValueError, match=r"fewer files: 10 < 11"):
        shard_files(ten_files, 11, 0)
    with pytest.raises(ValueError, match="list_files"):
        shard_files(Pipeline.range(10), 2, 0)


def test_shard_data_appends_shard_at_the_end() -> None:
    pipeline = Pipeline.range(10).batch(2, collate_fn=list)
    sharded = shard_data(pipeline, 2, 1)
    assert isinstance(sharded.transforms[-1], Shard)
    assert len(sharded.transforms) == len(pipeline.transforms) + 1
    assert list(sharded) == [[2, 3], [6, 7]]
    assert list(pipeline) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]


def test_resolve_shard_hints_replaces_every_placeholder() -> None:
    pipeline = Pipeline.range(12).shard(SHARD_HINT, SHARD_HINT).map(lambda x: x * 10)
    assert pipeline.has_shard_hint
    resolved, found = resolve_shard_hints(pipeline, 4, 3)
    assert found and not resolved.has_shard_hint
    assert list(resolved) == [30, 70, 110]
    partial, found = resolve_shard_hints(Pipeline.range(12).shard(SHARD_HINT, 1), 3, 0)
    assert found and list(partial) == [1, 4, 7, 10]


def test_resolve_shard_hints_leaves_plain_pipelines_alone() -> None:
    pipeline = Pipeline.range(6).shard(2, 0)
    resolved, found = resolve_shard_hints(pipeline, 3, 1)
    assert not found and resolved is pipeline
    assert list(resolved) == [0, 2, 4]


def test_unresolved_hint_is_a_clear_error_locally() -> None:
    pipeline = Pipeline.range(4).shard(SHARD_HINT, SHARD_HINT)
    with pytest.raises(ValueError, match="unresolved SHARD_HINT.*HINT"):
        iter(pipeline)
    assert repr(pipeline).endswith("shard(SHARD_HINT, SHARD_HINT)")


def test_shard_hint_survives_pickling() -> None:
    assert pickle.loads(pickle.dumps(SHARD_HINT)) is SHARD_HINT
    pipeline = cloudpickle.loads(cloudpickle.dumps(Pipeline.range(4).shard(SHARD_HINT, 0)))
    assert pipeline.has_shard_hint
    assert list(resolve_shard_hints(pipeline, 2, 1)[0]) == [0, 2]


# ---------------------------------------------------------------------- the worker's plan
def _plan(policy: ShardingPolicy, executors: int = 4, *, workers: int = 3, index: int = 1,
          **dataset: object):
    task = common_pb2.TaskDef(sharding_policy=policy, num_workers=workers, worker_index=index)
    return plan_replicas(task, common_pb2.DatasetDef(**dataset), executors)


def test_the_plan_runs_one_replica_per_executor_when_order_allows() -> None:
    dynamic = _plan(ShardingPolicy.DYNAMIC, splittable=True)
    assert dynamic.replicas == (ReplicaPlan(use_splits=True),) * 4
    assert dynamic.use_splits and not dynamic.local_splits
    off = _plan(ShardingPolicy.OFF, splittable=True)
    assert off.replicas == (ReplicaPlan(use_splits=True),) * 4 and off.local_splits
    # Position-dependent transforms (take, skip, shard) or an unsplittable source: one copy.
    for plan in (_plan(ShardingPolicy.OFF, splittable=True, order_sensitive=True),
                 _plan(ShardingPolicy.OFF, splittable=False),
                 _plan(ShardingPolicy.OFF, 1, splittable=True)):
        assert plan.replicas == (ReplicaPlan(),) and not plan.use_splits


def test_the_plan_shards_files_then_divides_this_workers_files_among_executors() -> None:
    plan = _plan(ShardingPolicy.FILE_OR_DATA, file_based=True, num_files=7)  # files 1, 4
    here = Rewrite(RewriteKind.FILES, 3, 1)
    assert plan.replicas == (ReplicaPlan((here, Rewrite(RewriteKind.FILES, 2, 0))),
                             ReplicaPlan((here, Rewrite(RewriteKind.FILES, 2, 1))))
    ordered = _plan(ShardingPolicy.FILE, file_based=True, num_files=7, order_sensitive=True)
    assert ordered.replicas == (ReplicaPlan((here,)),)
    assert _plan(ShardingPolicy.FILE_OR_DATA).replicas == (
        ReplicaPlan((Rewrite(RewriteKind.DATA, 3, 1),)),)
    assert _plan(ShardingPolicy.HINT).replicas == (
        ReplicaPlan((Rewrite(RewriteKind.HINTS, 3, 1),)),)
    with pytest.raises(ValueError, match="unknown sharding policy 9"):
        _plan(9)  # type: ignore[arg-type]


def test_a_replica_plan_rewrites_the_pipeline_and_survives_pickling(ten_files: Pipeline) -> None:
    plan = ReplicaPlan((Rewrite(RewriteKind.FILES, 3, 1), Rewrite(RewriteKind.FILES, 2, 1)))
    assert pickle.loads(pickle.dumps(plan)) == plan  # it travels to the executor processes
    assert plan.apply(ten_files).files == ten_files.files[1::3][1::2]
    hinted = Pipeline.range(10).shard(SHARD_HINT, SHARD_HINT)
    assert list(ReplicaPlan((Rewrite(RewriteKind.HINTS, 5, 2),)).apply(hinted)) == [2, 7]
    assert list(ReplicaPlan((Rewrite(RewriteKind.DATA, 4, 3),)).apply(Pipeline.range(10))) == [
        3, 7]

"""Static sharding (FILE, DATA, FILE_OR_DATA, HINT) with the dispatcher's fixed worker list.

Workers get chosen free ports so the list (`worker_addresses`) is known before they start.
Each element is tagged with the pid of the executor process that made it, so a test can tell
which worker produced what.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

import torch_dataservice as tds
from tests.conftest import HOST, Cluster, free_port, subprocess_env

pytestmark = pytest.mark.integration

N_WORKERS = 2


def tag(value: object) -> tuple[object, int]:
    return value, os.getpid()


def static_cluster(cluster_factory, num_workers: int = N_WORKERS,
                   num_processes: int = 1) -> Cluster:
    ports = [free_port() for _ in range(num_workers)]
    cluster = cluster_factory(num_workers=0, num_processes=num_processes,
                              worker_addresses=[f"{HOST}:{p}" for p in ports])
    for port in ports:
        cluster.add_worker(port=port)
    return cluster


def executor_pid(worker: tds.WorkerServer) -> int:
    return worker._tasks._executors._slots[0].process.pid  # noqa: SLF001 (test introspection)


def by_worker(cluster: Cluster, tagged: list[tuple[object, int]]) -> list[list[object]]:
    """The values each worker (in fixed-list order) produced, in arrival order."""
    pids = [executor_pid(w) for w in cluster.workers]
    assert {pid for _, pid in tagged} <= set(pids)
    return [[value for value, pid in tagged if pid == worker_pid] for worker_pid in pids]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("shards")
    paths = []
    for i in range(5):
        path = root / f"part-{i}.txt"
        path.write_text(f"file {i}")
        paths.append(str(path))
    return paths


@pytest.fixture(scope="module")
def cluster(request) -> Iterator[Cluster]:
    from tests.conftest import _make_cluster

    ports = [free_port() for _ in range(N_WORKERS)]
    made = _make_cluster(0, num_processes=1, worker_addresses=[f"{HOST}:{p}" for p in ports])
    try:
        for port in ports:
            made.add_worker(port=port)
        yield made
    finally:
        made.stop()


def read(pipeline: tds.Pipeline, policy: tds.ShardingPolicy, target: str, **kw) -> list:
    return list(pipeline.apply(tds.distribute(policy, target, **kw)))


def test_file_sharding_gives_worker_i_files_i_mod_n(cluster: Cluster, files: list[str]) -> None:
    pipeline = tds.Pipeline.list_files(files).map(tag)
    got = by_worker(cluster, read(pipeline, tds.ShardingPolicy.FILE, cluster.target))
    assert [sorted(g) for g in got] == [files[i::N_WORKERS] for i in range(N_WORKERS)]


def test_file_or_data_on_files_is_file_sharding(cluster: Cluster, files: list[str]) -> None:
    pipeline = tds.Pipeline.list_files(files).map(tag)
    got = by_worker(cluster, read(pipeline, tds.ShardingPolicy.FILE_OR_DATA, cluster.target))
    assert [sorted(g) for g in got] == [files[i::N_WORKERS] for i in range(N_WORKERS)]


def test_fewer_files_than_workers_is_an_error_at_the_consumer(
        cluster: Cluster, files: list[str]) -> None:
    with pytest.raises(ValueError, match=r"fewer files \(1\) than workers \(2\)"):
        read(tds.Pipeline.list_files(files[:1]), tds.ShardingPolicy.FILE, cluster.target)


def test_file_sharding_of_a_non_file_source_is_an_error(cluster: Cluster) -> None:
    with pytest.raises(ValueError, match="list_files"):
        read(tds.Pipeline.range(10), tds.ShardingPolicy.FILE, cluster.target)


@pytest.mark.parametrize("policy", [tds.ShardingPolicy.DATA, tds.ShardingPolicy.FILE_OR_DATA])
def test_data_sharding_keeps_element_k_on_worker_k_mod_n(
        cluster: Cluster, policy: tds.ShardingPolicy) -> None:
    got = by_worker(cluster, read(tds.Pipeline.range(20).map(tag), policy, cluster.target))
    assert got == [list(range(i, 20, N_WORKERS)) for i in range(N_WORKERS)]


def test_hint_replaces_the_placeholder_with_num_workers_and_index(cluster: Cluster) -> None:
    pipeline = tds.Pipeline.range(20).shard(tds.SHARD_HINT, tds.SHARD_HINT).map(tag)
    got = by_worker(cluster, read(pipeline, tds.ShardingPolicy.HINT, cluster.target))
    assert got == [list(range(i, 20, N_WORKERS)) for i in range(N_WORKERS)]


def test_static_sharding_reads_local_workers_explicitly(cluster: Cluster) -> None:
    got = read(tds.Pipeline.range(10), tds.ShardingPolicy.DATA, cluster.target,
               target_workers="LOCAL")
    assert sorted(got) == list(range(10))


def test_static_sharding_with_target_workers_any_is_an_error(cluster: Cluster) -> None:
    with pytest.raises(ValueError, match="requires reading from local workers"):
        read(tds.Pipeline.range(10), tds.ShardingPolicy.DATA, cluster.target,
             target_workers="ANY")


def test_hint_without_placeholder_leaves_the_pipeline_and_warns(
        cluster_factory, caplog: pytest.LogCaptureFixture) -> None:
    # Executors on threads of this process, so their log is this process's log.
    small = static_cluster(cluster_factory, num_processes=0)
    with caplog.at_level(logging.WARNING):
        got = read(tds.Pipeline.range(6), tds.ShardingPolicy.HINT, small.target)
    assert Counter(got) == {k: N_WORKERS for k in range(6)}
    assert "no shard(SHARD_HINT, SHARD_HINT)" in caplog.text


def test_static_policy_without_a_worker_list_is_an_error(cluster_factory) -> None:
    plain = cluster_factory(num_workers=1, num_processes=0)
    for policy in (tds.ShardingPolicy.DATA, tds.ShardingPolicy.HINT):
        with pytest.raises(ValueError, match="needs a fixed worker list"):
            read(tds.Pipeline.range(4), policy, plain.target)


def test_a_worker_not_on_the_list_is_refused(
        cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        stranger = tds.WorkerServer(tds.WorkerConfig(cluster.address, host=HOST,
                                                     num_processes=0))
    try:
        assert stranger.refused is not None
        assert "not in the dispatcher's fixed worker list" in stranger.refused
        assert stranger.join(timeout=0)
        assert "refused this worker" in caplog.text
    finally:
        stranger.stop()


def test_cli_worker_not_on_the_list_exits_non_zero(cluster: Cluster) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "torch_dataservice", "worker", "--dispatcher", cluster.address,
         "--host", HOST, "--port", str(free_port()), "--processes", "0"],
        capture_output=True, text=True, timeout=90, env=subprocess_env(),
        cwd=str(Path(__file__).resolve().parents[2]))
    assert proc.returncode != 0
    assert "not in the dispatcher's fixed worker list" in proc.stderr


def slow(x: int) -> int:
    time.sleep(0.01)
    return x


def test_a_restarted_worker_processes_its_shard_again(cluster_factory) -> None:
    small = static_cluster(cluster_factory, num_processes=0)
    n = 200
    it = iter(tds.Pipeline.range(n).map(slow).apply(
        tds.distribute(tds.ShardingPolicy.DATA, small.target, max_outstanding_requests=1)))
    before = [next(it) for _ in range(20)]
    restarted = small.workers[1]
    port = restarted.port
    small.stop_worker(restarted)
    small.add_worker(port=port)
    got = before + list(it)
    counts = Counter(got)
    assert all(counts[k] == 1 for k in range(0, n, 2)), "worker 0's shard exactly once"
    assert all(counts[k] >= 1 for k in range(1, n, 2)), "worker 1's whole shard"
    # What worker 1 delivered before its restart comes again: it started its shard over.
    assert all(counts[k] == 2 for k in before if k % 2 == 1)
    assert any(k % 2 == 1 for k in before)


def slow_odd(x: int) -> int:
    if x % 2:
        time.sleep(0.02)
    return x


def test_a_worker_restarted_after_the_others_finished_reads_its_shard(cluster_factory) -> None:
    # Worker 0's shard (even elements) is fast and ends first; worker 1 is restarted while it
    # is the last one running: the iteration must wait for it, not end with the shard half read.
    small = static_cluster(cluster_factory, num_processes=0)
    state = small.dispatcher._service.state  # noqa: SLF001 (test introspection)
    n = 100
    # HINT shards before the map, so only worker 1 (odd elements) is slow.
    pipeline = tds.Pipeline.range(n).shard(tds.SHARD_HINT, tds.SHARD_HINT).map(slow_odd)
    it = iter(pipeline.apply(
        tds.distribute(tds.ShardingPolicy.HINT, small.target, max_outstanding_requests=1)))
    got = []
    deadline = time.monotonic() + 60
    worker0 = small.workers[0].address
    while not any(t.finished and t.worker_address == worker0 for t in state.tasks.values()):
        got.append(next(it))
        assert time.monotonic() < deadline, "worker 0's task never finished"
    restarted = small.workers[1]
    port = restarted.port
    small.stop_worker(restarted)
    small.add_worker(port=port)
    got += list(it)
    counts = Counter(got)
    assert all(counts[k] == 1 for k in range(0, n, 2)), "worker 0's shard exactly once"
    assert all(counts[k] >= 1 for k in range(1, n, 2)), "worker 1's whole shard, after restart"

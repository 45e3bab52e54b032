"""Executor processes run torch on one thread by default (as torch's DataLoader workers do), so
N processes use N cores instead of N x cores threads fighting for them; WorkerConfig (and the
CLI's --executor-torch-threads) choose otherwise."""

from __future__ import annotations

import pytest

import torch_dataservice as tds


def torch_threads(_: int) -> int:
    import torch

    return torch.get_num_threads()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("threads", "expected"), [(1, 1), (2, 2)])
def test_executor_processes_set_torch_threads(cluster_factory, threads: int,
                                              expected: int) -> None:
    cluster = cluster_factory(num_workers=0)
    cluster.add_worker(num_processes=1, executor_torch_threads=threads)
    dataset = tds.Pipeline.range(3).map(torch_threads).apply(
        tds.distribute("parallel_epochs", cluster.target))
    assert list(dataset) == [expected] * 3


@pytest.mark.timeout(30)
def test_the_knob_is_validated_and_defaults_to_one() -> None:
    assert tds.WorkerConfig("localhost:1").executor_torch_threads == 1
    assert tds.WorkerConfig("localhost:1", executor_torch_threads=None).executor_torch_threads \
        is None
    with pytest.raises(ValueError, match="executor_torch_threads.*got 0"):
        tds.WorkerConfig("localhost:1", executor_torch_threads=0)


@pytest.mark.timeout(90)
def test_the_cli_flag_reaches_the_executor_processes(process_cluster) -> None:
    process_cluster.start_dispatcher()
    process_cluster.start_worker("--executor-torch-threads", "2")
    dataset = tds.Pipeline.range(3).map(torch_threads).apply(
        tds.distribute("parallel_epochs", process_cluster.target))
    assert list(dataset) == [2] * 3

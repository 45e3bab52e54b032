"""What a job reads, with real servers on loopback: processing modes, jobs, epochs, datasets."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import Counter
from typing import Any

import pytest

import torch_dataservice as tds
from tests.conftest import Cluster, subprocess_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def read_concurrently(*pipelines: tds.Pipeline) -> list[list[Any]]:
    """Iterate every pipeline on its own thread at once; their elements, in order."""
    results: list[list[Any]] = [[] for _ in pipelines]
    errors: list[BaseException] = []

    def read(i: int) -> None:
        try:
            results[i].extend(pipelines[i])
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(pipelines))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a reader hung"
    if errors:
        raise errors[0]
    return results


# ---------------------------------------------------------------------- processing modes
def test_parallel_epochs_gives_every_element_once_per_worker(shared_cluster: Cluster) -> None:
    pipeline = tds.Pipeline.range(10).apply(tds.distribute("parallel_epochs",
                                                           shared_cluster.target))
    assert sorted(pipeline) == sorted(list(range(10)) * 2)


def test_distributed_epoch_gives_every_element_once(shared_cluster: Cluster) -> None:
    pipeline = tds.Pipeline.range(100).apply(tds.distribute("distributed_epoch",
                                                            shared_cluster.target))
    assert sorted(pipeline) == list(range(100))


def test_every_form_of_the_service_address(shared_cluster: Cluster) -> None:
    address = shared_cluster.address
    for service in (address, ("grpc", address), f"grpc://{address}"):
        pipeline = tds.Pipeline.range(12).apply(tds.distribute("distributed_epoch", service))
        assert sorted(pipeline) == list(range(12))


def test_policies_are_accepted_as_enum_values(shared_cluster: Cluster) -> None:
    off = tds.Pipeline.range(3).apply(tds.distribute(tds.ShardingPolicy.OFF,
                                                     shared_cluster.target))
    dynamic = tds.Pipeline.range(30).apply(tds.distribute(tds.ShardingPolicy.DYNAMIC,
                                                          shared_cluster.target))
    assert sorted(off) == [0, 0, 1, 1, 2, 2]
    assert sorted(dynamic) == list(range(30))


def test_transforms_after_distribute_run_locally(shared_cluster: Cluster) -> None:
    import os

    pipeline = (tds.Pipeline.range(5).map(lambda x: x * x)
                .apply(tds.distribute("parallel_epochs", shared_cluster.target))
                .map(lambda x: x + 1))
    assert sorted(pipeline) == [1, 1, 2, 2, 5, 5, 10, 10, 17, 17]
    # A map after distribute sees this process; one before it runs in an executor process.
    here = os.getpid()
    remote = (tds.Pipeline.range(2).map(lambda x: os.getpid())
              .apply(tds.distribute("parallel_epochs", shared_cluster.target))
              .map(lambda pid: (pid, os.getpid())))
    pairs = list(remote)
    assert len(pairs) == 4
    assert all(local == here and worker != here for worker, local in pairs)


def test_dynamic_on_an_unsplittable_source_is_a_value_error(shared_cluster: Cluster) -> None:
    target = shared_cluster.target
    pipeline = tds.Pipeline.from_iterable(lambda: iter(range(3)))
    with pytest.raises(ValueError, match="DYNAMIC.*splittable"):
        pipeline.apply(tds.distribute("distributed_epoch", target))
    dataset_id = tds.register_dataset(target, pipeline)
    with pytest.raises(ValueError, match="DYNAMIC.*splittable"):
        list(tds.from_dataset_id("distributed_epoch", target, dataset_id))
    # The same source is fine where every worker runs all of it.
    assert sorted(pipeline.apply(tds.distribute("parallel_epochs", target))) == [
        0, 0, 1, 1, 2, 2]
    assert sorted(tds.from_dataset_id("parallel_epochs", target, dataset_id)) == [
        0, 0, 1, 1, 2, 2]


@pytest.mark.timeout(60)
def test_a_cpu_bound_map_on_two_executor_processes(cluster_factory, tmp_path) -> None:
    import os
    import time

    cluster = cluster_factory(num_workers=1, num_processes=2)
    directory = str(tmp_path)

    def spin(x: int) -> tuple[int, int]:
        # Each process leaves its pid, then waits (bounded) until two processes took work:
        # with one split in hand the first cannot take them all, so the second gets some.
        open(os.path.join(directory, str(os.getpid())), "w").close()
        deadline = time.monotonic() + 20
        while len(os.listdir(directory)) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        total = 0
        for i in range(20_000):
            total += (i * x) % 7
        return total, os.getpid()

    def expected(x: int) -> int:
        return sum((i * x) % 7 for i in range(20_000))

    off = list(tds.Pipeline.range(30).map(spin)
               .apply(tds.distribute("parallel_epochs", cluster.target)))
    assert sorted(value for value, _ in off) == sorted(expected(x) for x in range(30))
    assert len({pid for _, pid in off}) == 2  # both executor processes did work
    dynamic = list(tds.Pipeline.range(30).map(spin)
                   .apply(tds.distribute("distributed_epoch", cluster.target)))
    assert sorted(value for value, _ in dynamic) == sorted(expected(x) for x in range(30))
    # Position-dependent transforms stay correct: take(10) is the first 10, not 10 per process.
    taken = list(tds.Pipeline.range(60).map(lambda x: x * 3).take(10)
                 .apply(tds.distribute("parallel_epochs", cluster.target)))
    assert taken == [x * 3 for x in range(10)]


# ---------------------------------------------------------------------- datasets
def test_the_same_pipeline_registered_twice_gets_the_same_id(shared_cluster: Cluster) -> None:
    pipeline = tds.Pipeline.range(7).map(lambda x: x - 1)
    first = tds.register_dataset(shared_cluster.target, pipeline)
    assert tds.register_dataset(shared_cluster.target, pipeline) == first
    assert tds.register_dataset(shared_cluster.target, tds.Pipeline.range(8)) != first
    # Compression is part of the dataset: the same pipeline uncompressed is another one.
    assert tds.register_dataset(shared_cluster.target, pipeline, compression=None) != first


def test_an_explicit_dataset_id_is_reused(shared_cluster: Cluster) -> None:
    target = shared_cluster.target
    assert tds.register_dataset(target, tds.Pipeline.range(3), dataset_id="squares") == "squares"
    # The id exists: the registered pipeline stays, the new one is not registered under it.
    assert tds.register_dataset(target, tds.Pipeline.range(100), dataset_id="squares") == "squares"
    pipeline = tds.from_dataset_id("distributed_epoch", target, "squares")
    assert sorted(pipeline) == [0, 1, 2]


def test_from_dataset_id_in_a_second_process(shared_cluster: Cluster) -> None:
    dataset_id = tds.register_dataset(shared_cluster.target,
                                      tds.Pipeline.range(6).map(lambda x: x * 3))
    script = (
        "import json, sys\n"
        "import torch_dataservice as tds\n"
        "pipeline = tds.from_dataset_id('parallel_epochs', sys.argv[1], sys.argv[2])\n"
        "print(json.dumps(sorted(pipeline)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, shared_cluster.target, dataset_id],
        capture_output=True, text=True, timeout=50, env=subprocess_env())
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == sorted([0, 3, 6, 9, 12, 15] * 2)


def test_from_dataset_id_reads_here_too(shared_cluster: Cluster) -> None:
    dataset_id = tds.register_dataset(shared_cluster.target, tds.Pipeline.range(20))
    pipeline = tds.from_dataset_id("distributed_epoch", shared_cluster.target, dataset_id)
    assert sorted(pipeline) == list(range(20))
    with pytest.raises(LookupError, match="no-such-dataset"):
        list(tds.from_dataset_id("parallel_epochs", shared_cluster.target, "no-such-dataset"))


# ---------------------------------------------------------------------- jobs and epochs
def test_consumers_of_one_job_name_share_each_epoch(shared_cluster: Cluster) -> None:
    base = tds.Pipeline.range(200)

    def consumer() -> tds.Pipeline:
        return base.apply(tds.distribute("distributed_epoch", shared_cluster.target,
                                         job_name="shared-epochs"))

    first, second = consumer(), consumer()
    for _epoch in range(2):  # the k-th iteration of each object joins iteration k of the job
        a, b = read_concurrently(first, second)
        assert sorted(a + b) == list(range(200))


def test_the_kth_iteration_joins_iteration_k(shared_cluster: Cluster) -> None:
    def consumer() -> tds.Pipeline:
        return tds.Pipeline.range(50).apply(tds.distribute(
            "distributed_epoch", shared_cluster.target, job_name="kth-iteration"))

    early = consumer()
    assert sorted(early) == list(range(50))  # epoch 0 of the job
    assert sorted(early) == list(range(50))  # epoch 1: iterating again starts the next epoch
    late = consumer()
    # Its first iteration joins epoch 0, which `early` already read in full.
    assert list(late) == []
    assert list(late) == []  # epoch 1, also read in full
    assert sorted(late) == list(range(50))  # epoch 2 is new


def test_parallel_epochs_job_shared_by_two_consumers(shared_cluster: Cluster) -> None:
    def consumer() -> tds.Pipeline:
        return tds.Pipeline.range(30).apply(tds.distribute(
            "parallel_epochs", shared_cluster.target, job_name="shared-off"))

    a, b = read_concurrently(consumer(), consumer())
    assert Counter(a + b) == Counter({i: 2 for i in range(30)})  # one job: two workers' worth


def test_anonymous_jobs_are_exclusive(shared_cluster: Cluster) -> None:
    pipeline = tds.Pipeline.range(40).apply(tds.distribute("distributed_epoch",
                                                           shared_cluster.target))
    other = tds.Pipeline.range(40).apply(tds.distribute("distributed_epoch",
                                                        shared_cluster.target))
    a, b = read_concurrently(pipeline, other)
    assert sorted(a) == sorted(b) == list(range(40))
    a, b = read_concurrently(pipeline, pipeline)  # even two iterations of one object
    assert sorted(a) == sorted(b) == list(range(40))


def test_iterating_again_starts_the_next_epoch(shared_cluster: Cluster) -> None:
    anonymous = tds.Pipeline.range(25).apply(tds.distribute("distributed_epoch",
                                                            shared_cluster.target))
    named = tds.Pipeline.range(25).apply(tds.distribute(
        "distributed_epoch", shared_cluster.target, job_name="next-epoch"))
    for pipeline in (anonymous, named):
        for _ in range(3):
            assert sorted(pipeline) == list(range(25))


def test_repeat_after_distribute_reads_several_epochs(shared_cluster: Cluster) -> None:
    anonymous = (tds.Pipeline.range(10)
                 .apply(tds.distribute("distributed_epoch", shared_cluster.target)).repeat(3))
    assert Counter(anonymous) == Counter({i: 3 for i in range(10)})
    named = (tds.Pipeline.range(10)
             .apply(tds.distribute("distributed_epoch", shared_cluster.target,
                                   job_name="repeat-after"))
             .repeat(3))
    assert Counter(named) == Counter({i: 3 for i in range(10)})
    off = (tds.Pipeline.range(4)
           .apply(tds.distribute("parallel_epochs", shared_cluster.target)).repeat(2))
    assert Counter(off) == Counter({i: 4 for i in range(4)})  # 2 workers x 2 epochs


def test_repeat_before_distribute_runs_on_the_workers(shared_cluster: Cluster) -> None:
    pipeline = tds.Pipeline.range(10).repeat(2).apply(
        tds.distribute("distributed_epoch", shared_cluster.target))
    assert Counter(pipeline) == Counter({i: 2 for i in range(10)})


def test_a_job_name_with_another_processing_mode_is_an_error(shared_cluster: Cluster) -> None:
    base = tds.Pipeline.range(5)
    dynamic = base.apply(tds.distribute("distributed_epoch", shared_cluster.target,
                                        job_name="mode-clash"))
    assert sorted(dynamic) == list(range(5))
    off = base.apply(tds.distribute("parallel_epochs", shared_cluster.target,
                                    job_name="mode-clash"))
    with pytest.raises(ValueError, match="sharding_policy"):
        list(off)


def test_a_job_name_with_other_reader_options_is_an_error(shared_cluster: Cluster) -> None:
    target = shared_cluster.target
    dataset_id = tds.register_dataset(target, tds.Pipeline.range(5))
    plain = tds.from_dataset_id("parallel_epochs", target, dataset_id, job_name="options")
    assert sorted(plain) == sorted(list(range(5)) * 2)
    local = tds.from_dataset_id("parallel_epochs", target, dataset_id, job_name="options",
                                target_workers="LOCAL")
    with pytest.raises(ValueError, match="target_workers"):
        list(local)
    # from_dataset_id scopes job names by dataset: another dataset may use the same name.
    other_id = tds.register_dataset(target, tds.Pipeline.range(3))
    other = tds.from_dataset_id("distributed_epoch", target, other_id, job_name="options")
    assert sorted(other) == [0, 1, 2]

"""`cache()` on real workers: epoch 2 reads the executors' shared cache (the function before
the cache is not called again, in any process), a split cut short is never an entry, a killed
executor's split is computed again whole, and the worker's figures and cached splits."""

from __future__ import annotations

import functools
import itertools
import os
import random
import signal
import threading
import time
import uuid

import pytest
import torch

import torch_dataservice as tds
from tests.conftest import wait_until
from torch_dataservice.pipeline.cache import decode_entry
from torch_dataservice.worker import metrics

pytestmark = pytest.mark.integration

SPLIT = 8
SPLITS = 8


def record(directory: str, x: int) -> int:
    """The step before the cache: leaves a file per call (from any executor process); element
    `x == 27` waits for the file `go` while the file `hold` exists."""
    with open(os.path.join(directory, f"{x}-{os.getpid()}-{uuid.uuid4().hex}"), "w"):
        pass
    if x == 27:
        deadline = time.monotonic() + 30
        while (os.path.exists(os.path.join(directory, "hold"))
               and not os.path.exists(os.path.join(directory, "go"))
               and time.monotonic() < deadline):
            time.sleep(0.01)
    return x * 10


def calls(directory) -> list[int]:
    return sorted(int(name.split("-")[0]) for name in os.listdir(directory)
                  if name[0].isdigit())


def pipeline(directory) -> tds.Pipeline:
    return (tds.Pipeline.range(SPLIT * SPLITS).with_split_size(SPLIT)
            .map(functools.partial(record, str(directory))).cache()
            .map(lambda x: x + random.random()))


def read(cluster, directory, job: str) -> list[int]:
    reader = pipeline(directory).apply(
        tds.distribute("distributed_epoch", cluster.target, job_name=job))
    return sorted(int(x) for x in reader)


def entries(worker) -> dict[str, int]:
    """Each entry of the worker's cache directory, with how many elements it holds."""
    found = {}
    for root, _, files in os.walk(worker.cache.directory):
        for name in files:
            if not name.startswith(".tmp-"):
                with open(os.path.join(root, name), "rb") as file:
                    found[name] = len(list(decode_entry(file.read())))
    return found


@pytest.mark.timeout(120)
def test_epoch_two_reads_the_workers_cache_and_a_stopped_split_is_no_entry(
        cluster_factory, tmp_path) -> None:
    cluster = cluster_factory(num_workers=1, num_processes=2, job_gc_timeout_ms=300)
    (worker,) = cluster.workers
    everything = [x * 10 for x in range(SPLIT * SPLITS)]
    # A read stopped early, in the middle of split 3 (element 27 waits): the split cut short
    # must not become an entry.
    (tmp_path / "hold").write_text("")
    stopped = pipeline(tmp_path).apply(tds.distribute("distributed_epoch", cluster.target,
                                                      job_name="stopped"))
    iterator = iter(stopped)
    list(itertools.islice(iterator, 3))
    wait_until(lambda: 27 in calls(tmp_path), 60, "split 3 under way")
    iterator.close()
    del iterator, stopped
    wait_until(lambda: not worker._tasks.task_ids(), 30, "the stopped task deleted")
    (tmp_path / "go").write_text("")
    time.sleep(1)
    assert "3" not in entries(worker)
    assert all(count == SPLIT for count in entries(worker).values()), entries(worker)
    for name in os.listdir(tmp_path):
        if name[0].isdigit():
            os.unlink(tmp_path / name)

    assert read(cluster, tmp_path, "epoch-1") == everything
    called = calls(tmp_path)
    assert set(range(24, 32)) <= set(called)  # split 3, never kept, is computed again
    assert entries(worker) == {str(i): SPLIT for i in range(SPLITS)}
    assert read(cluster, tmp_path, "epoch-2") == everything  # another job, the same pipeline
    assert calls(tmp_path) == called  # nothing computed again, in any executor process
    hits = wait_until(lambda: worker.cache.counts()[0] >= SPLITS, 10, "the hits reported")
    assert hits
    (splits,) = worker.cache.cached_splits().values()
    assert list(splits) == list(range(SPLITS))
    assert worker.cache.nbytes() > 0
    families = {family.name: family.samples[0].value for family in metrics.collector(
        worker.service.counters, worker._tasks.stages, worker.cache, lambda: 0)()}
    assert families["tds_worker_cache_hits"] >= SPLITS
    assert families["tds_worker_cache_misses"] >= SPLITS
    assert families["tds_worker_cache_bytes"] == worker.cache.nbytes()
    assert families["tds_worker_cache_evictions"] == 0
    load = metrics.load(worker.service.counters, worker._tasks.stages, worker.cache,
                        buffered=0, processes=2)
    assert load.cache_hits >= SPLITS and load.cache_bytes > 0
    directory = worker.cache.directory
    cluster.stop_worker(worker)
    assert not os.path.exists(directory)  # the worker's shared memory is given back


@pytest.mark.timeout(120)
def test_a_split_cut_short_by_a_killed_executor_is_never_an_entry(
        cluster_factory, tmp_path) -> None:
    cluster = cluster_factory(num_workers=1, num_processes=1)
    (worker,) = cluster.workers
    (tmp_path / "hold").write_text("")
    errors: list[BaseException] = []
    reader = pipeline(tmp_path).apply(tds.distribute("distributed_epoch", cluster.target,
                                                     job_name="killed"))

    def consume() -> None:
        try:
            list(reader)
        except tds.RemoteError as error:  # the task's executor died: its reader is told
            errors.append(error)

    thread = threading.Thread(target=consume)
    thread.start()
    # Element 27 (split 3) waits: its executor is killed in the middle of split 3.
    wait_until(lambda: 27 in calls(tmp_path), 60, "split 3 under way")
    (pid,) = {int(name.split("-")[1]) for name in os.listdir(tmp_path)
              if name.startswith("27-")}
    os.kill(pid, signal.SIGKILL)
    thread.join(60)
    assert not thread.is_alive() and errors
    assert "3" not in entries(worker)
    assert all(count == SPLIT for count in entries(worker).values())
    (tmp_path / "go").write_text("")
    # The next epoch computes split 3 again, whole, with the restarted executor.
    assert read(cluster, tmp_path, "after-kill") == [x * 10 for x in range(SPLIT * SPLITS)]
    assert entries(worker) == {str(i): SPLIT for i in range(SPLITS)}
    assert calls(tmp_path).count(24) == 2


class _Loads(torch.utils.data.Dataset):
    """Leaves a file per load, from whichever executor process runs it."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> torch.Tensor:
        record(self.directory, index)
        return torch.full((4,), index)


@pytest.mark.timeout(120)
def test_a_cached_dataset_loads_each_index_once_over_dataloader_epochs(
        cluster_factory, tmp_path) -> None:
    cluster = cluster_factory(num_workers=1, num_processes=2)
    dataset = tds.CachedDataset(_Loads(str(tmp_path)), lambda t: t + torch.rand(4))
    loader = tds.DataLoader(dataset, batch_size=4, shuffle=True, num_workers=2,
                            service=cluster.target)
    for _ in range(2):
        rows = sorted(int(row[0]) for batch in loader for row in batch)
        assert rows == list(range(24))
    assert calls(tmp_path) == list(range(24))  # epoch 2 loaded nothing again

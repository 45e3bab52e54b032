"""A DataLoader's dataset travels once, and workers free what no task needs: reading many
epochs of a large in-memory dataset does not grow the worker's memory with the epochs."""

from __future__ import annotations

import psutil
import pytest
import torch
from torch.utils.data import Dataset

import torch_dataservice as tds
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(120)

MB = 1 << 20


class Big(Dataset):
    """64 rows of 256 KiB of noise (16 MiB that no compression shrinks)."""

    def __init__(self) -> None:
        self.rows = torch.randint(0, 1 << 30, (64, 64 * 1024), dtype=torch.int32)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.rows[i, :4].clone()


def _executor_rss(worker: tds.WorkerServer) -> int:
    slots = worker._tasks._executors._slots  # noqa: SLF001
    return sum(psutil.Process(slot.process.pid).memory_info().rss for slot in slots)


@pytest.mark.slow
def test_epochs_of_a_big_dataset_do_not_grow_worker_memory(cluster_factory) -> None:
    cluster = cluster_factory(num_workers=1, job_gc_timeout_ms=200,
                              job_gc_check_interval_ms=50)
    worker = cluster.workers[0]
    dataset = Big()
    loader = tds.DataLoader(dataset, batch_size=16, shuffle=True, service=cluster.target,
                            generator=torch.Generator().manual_seed(3))
    reference = torch.utils.data.DataLoader(dataset, batch_size=16, shuffle=True,
                                            generator=torch.Generator().manual_seed(3))
    slots = worker._tasks._executors._slots  # noqa: SLF001
    rss = []
    for epoch in range(10):
        ours = list(loader)
        theirs = list(reference)
        assert len(ours) == len(theirs) and all(
            torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), epoch
        # Sampled once the epoch's task is collected and its datasets released to the
        # executors: whether the next epoch's task arrives before that (the dataset stays on
        # the worker) or after (it is released and sent again) is a race of the timing, and
        # the two leave glibc's heap differently; waiting makes every epoch take the same path.
        wait_until(lambda: not worker._tasks.task_ids()  # noqa: SLF001
                   and not any(slot.datasets for slot in slots), 10,
                   f"epoch {epoch}'s task collected and its datasets released")
        rss.append(_executor_rss(worker))
    # No growth with the epochs (before: +16 MiB of pickle per epoch). glibc may keep a freed
    # 16 MiB buffer or two in its heap during the first epochs (its mmap threshold adapts
    # upwards), whichever way executors start: a plateau, so the later epochs are compared.
    # The executor handles a Release after the front sent it (a message on its pipe), so a
    # sample can still hold the dataset (+16 to 32 MiB): the last epoch's memory must come
    # back to the plateau, which a leak never does.
    plateau = min(rss[len(rss) // 2:])

    def settled() -> bool:
        rss[-1] = _executor_rss(worker)
        return rss[-1] - plateau < 8 * MB

    wait_until(settled, 10, f"the executors' memory back to the plateau (MiB: "
               f"{[r // MB for r in rss]})")

    state = cluster.dispatcher._service.state  # noqa: SLF001
    shared = [d for d in state.datasets.values() if d.definition.shared_object]
    assert len(shared) == 1  # registered once, not once per epoch
    # Every epoch's task is collected, and with it what the worker kept of the datasets.
    # (A deleted task leaves the task list before its datasets are released: wait for both.)
    wait_until(lambda: not worker._tasks.task_ids() and not worker._dispatcher._datasets,  # noqa: SLF001
               10, "tasks collected and their datasets forgotten")
    # And the dispatcher forgets each epoch's index batches (ephemeral datasets).
    wait_until(lambda: not [d for d in list(state.datasets.values())
                            if d.definition.ephemeral], 10, "epoch datasets dropped")
    assert list(state.datasets) == [shared[0].dataset_id]


def test_the_dispatcher_checks_references_between_datasets() -> None:
    from torch_dataservice.config import DispatcherConfig
    from torch_dataservice.dispatcher.journal import NullJournal
    from torch_dataservice.dispatcher.service import DispatcherService
    from torch_dataservice.proto import common_pb2
    from torch_dataservice.proto import dispatcher_pb2 as pb

    class Context:
        def abort(self, code, details):
            raise RuntimeError(f"{code.name}: {details}")

    service = DispatcherService(DispatcherConfig(), NullJournal())
    with pytest.raises(RuntimeError, match="NOT_FOUND: .* not registered"):
        service.GetOrRegisterDataset(pb.GetOrRegisterDatasetRequest(
            dataset=common_pb2.DatasetDef(pipeline=b"p", depends_on=["77"])), Context())
    shared = service.GetOrRegisterDataset(pb.GetOrRegisterDatasetRequest(
        dataset=common_pb2.DatasetDef(pipeline=b"o", shared_object=True, fingerprint="o")),
        None).dataset_id
    with pytest.raises(RuntimeError, match="INVALID_ARGUMENT: .*shared object"):
        service.GetOrCreateJob(pb.GetOrCreateJobRequest(
            config=common_pb2.JobConfig(dataset_id=shared, sharding_policy=1)), Context())
    service.close()


def test_a_shared_dataset_the_dispatcher_lost_is_registered_again(cluster) -> None:
    dataset = Big()
    loader = tds.DataLoader(dataset, batch_size=32, service=cluster.target)
    assert len(list(loader)) == 2
    state = cluster.dispatcher._service.state  # noqa: SLF001
    shared_id = loader._tds_registrar.shared[2]  # noqa: SLF001
    # As after a restart without a journal: the dataset is gone.
    fingerprint = state.datasets.pop(shared_id).definition.fingerprint
    state.dataset_by_fingerprint.pop(fingerprint)
    assert len(list(loader)) == 2
    assert loader._tds_registrar.shared[2] != shared_id  # noqa: SLF001

"""Ephemeral datasets (a DataLoader's per-epoch index batches) leave the dispatcher with the
last iteration that reads them, journaled like any other change."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dispatcher.builders import Clock, Context, make_service
from torch_dataservice.dispatcher.service import DispatcherService
from torch_dataservice.proto import common_pb2, dispatcher_pb2

pb = dispatcher_pb2
pytestmark = pytest.mark.timeout(30)


def register(service: DispatcherService, name: str, ephemeral: bool) -> str:
    definition = common_pb2.DatasetDef(pipeline=name.encode(), fingerprint=name,
                                       ephemeral=ephemeral)
    return service.GetOrRegisterDataset(pb.GetOrRegisterDatasetRequest(dataset=definition),
                                        None).dataset_id


def read_once(service: DispatcherService, dataset_id: str, job_name: str = "") -> int:
    """Create a job and an iteration, then release its client; returns the job id."""
    job = service.GetOrCreateJob(pb.GetOrCreateJobRequest(config=common_pb2.JobConfig(
        dataset_id=dataset_id, job_name=job_name)), None)
    client = service.GetOrCreateIteration(pb.GetOrCreateIterationRequest(job_id=job.job_id),
                                          None).client_id
    service.ReleaseIterationClient(pb.ReleaseIterationClientRequest(client_id=client), None)
    return job.job_id


def collect(service: DispatcherService, clock: Clock) -> None:
    service.check_liveness()  # notes the idle iterations
    clock.now += 2.0
    service.check_liveness()


def test_an_ephemeral_dataset_goes_with_its_last_iteration() -> None:
    clock = Clock()
    service = make_service(clock, job_gc_timeout_ms=1000)
    ephemeral = register(service, "epoch-3", ephemeral=True)
    kept = register(service, "forever", ephemeral=False)
    read_once(service, ephemeral)
    read_once(service, kept)
    assert {ephemeral, kept} <= set(service.state.datasets)
    collect(service, clock)
    assert ephemeral not in service.state.datasets
    assert "epoch-3" not in service.state.dataset_by_fingerprint
    assert kept in service.state.datasets


def test_it_stays_while_another_iteration_reads_it() -> None:
    clock = Clock()
    service = make_service(clock, job_gc_timeout_ms=1000)
    dataset_id = register(service, "epoch-4", ephemeral=True)
    read_once(service, dataset_id, "first")
    job = service.GetOrCreateJob(pb.GetOrCreateJobRequest(config=common_pb2.JobConfig(
        dataset_id=dataset_id, job_name="second")), None)
    service.GetOrCreateIteration(pb.GetOrCreateIterationRequest(job_id=job.job_id), None)
    collect(service, clock)
    assert dataset_id in service.state.datasets  # "second" still has a client


def test_removal_is_journaled_and_a_removed_dataset_cannot_be_read(tmp_path: Path) -> None:
    clock = Clock()
    service = make_service(clock, tmp_path, job_gc_timeout_ms=1000)
    dataset_id = register(service, "epoch-5", ephemeral=True)
    job_id = read_once(service, dataset_id, "named")
    collect(service, clock)
    service.close()
    restarted = make_service(Clock(), tmp_path, job_gc_timeout_ms=1000)
    assert dataset_id not in restarted.state.datasets
    with pytest.raises(RuntimeError, match=f"NOT_FOUND: dataset '{dataset_id}'"):
        restarted.GetOrCreateIteration(
            pb.GetOrCreateIterationRequest(job_id=job_id, repetition=1), Context())


def test_one_just_registered_again_is_kept_for_its_registrant() -> None:
    clock = Clock()
    service = make_service(clock, job_gc_timeout_ms=1000)
    dataset_id = register(service, "epoch-6", ephemeral=True)
    read_once(service, dataset_id, "first pass")
    service.check_liveness()  # the first pass's iteration is idle from now
    clock.now += 1.5
    # A second loader registers the same batches just before the first pass is collected.
    assert register(service, "epoch-6", ephemeral=True) == dataset_id
    service.check_liveness()
    assert dataset_id in service.state.datasets  # its registrant's job is on the way
    read_once(service, dataset_id, "second pass")
    collect(service, clock)
    assert dataset_id not in service.state.datasets


def test_one_no_job_reads_goes_after_job_gc_timeout(tmp_path: Path) -> None:
    """Issue 24.7: junk registrations (and ones whose registrant died before its job) were
    kept for ever; also those a restarted dispatcher replays."""
    clock = Clock()
    service = make_service(clock, tmp_path, job_gc_timeout_ms=1000)
    junk = {register(service, f"junk-{i}", ephemeral=True) for i in range(50)}
    kept = register(service, "forever", ephemeral=False)
    read = register(service, "epoch-7", ephemeral=True)
    job = service.GetOrCreateJob(pb.GetOrCreateJobRequest(config=common_pb2.JobConfig(
        dataset_id=read)), None)
    service.GetOrCreateIteration(pb.GetOrCreateIterationRequest(job_id=job.job_id), None)
    service.check_liveness()
    assert junk <= set(service.state.datasets)  # their registrants' jobs may be on the way
    clock.now += 1.5
    service.check_liveness()
    assert set(service.state.datasets) == {kept, read}  # "epoch-7" has a reader
    more = register(service, "junk-after", ephemeral=True)
    service.close()
    later = Clock()
    restarted = make_service(later, tmp_path, job_gc_timeout_ms=1000)
    assert more in restarted.state.datasets
    later.now += 1.5
    restarted.check_liveness()
    assert more not in restarted.state.datasets and kept in restarted.state.datasets

"""Resume of a DYNAMIC epoch from what readers yielded, with real in-process servers.

A reader reads part of an epoch of `Pipeline.range(N)` cut in splits; what it yielded
(`IterationReader.yielded`, completed with the dispatcher's split sizes) makes a new job's
`JobConfig.resume`; the readers of that job read exactly the rest, whatever the first reader
had received ahead, and across a dispatcher restart (fault-tolerant, work_dir)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

import torch_dataservice as tds
from tests.conftest import HOST
from torch_dataservice.client.api import ReadOptions, connect_timeout_s, split_sizes
from torch_dataservice.client.consumed import ConsumedSplits
from torch_dataservice.client.reader import IterationReader

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

N, SPLIT = 200, 10


def open_reader(target: str, dataset_id: str, job: str, resume: ConsumedSplits | None = None,
                max_outstanding: int | None = None) -> IterationReader:
    options = ReadOptions.build("distributed_epoch", target, job, None, None, max_outstanding,
                                None, "AUTO")
    config = options.job_config(dataset_id, job)
    if resume is not None:
        config.resume.CopyFrom(resume.to_proto())
    return IterationReader(options.address, config, 0, max_outstanding, connect_timeout_s(),
                           track_yielded=True)


def take(reader: IterationReader, count: int) -> list[int]:
    return [next(reader) for _ in range(count)]


def saved_state(target: str, reader: IterationReader) -> ConsumedSplits:
    """What `reader` yielded, with the splits read whole known as such."""
    assert reader.yielded is not None
    consumed = reader.yielded.copy()
    consumed.complete_with(split_sizes(target, reader.iteration_id, consumed.partial_keys()))
    return consumed


def read_together(readers: list[IterationReader]) -> list[list[int]]:
    """Every reader to its end, at once (they share one job)."""
    results: list[list[int]] = [[] for _ in readers]
    threads = [threading.Thread(target=lambda i=i: results[i].extend(readers[i]))
               for i in range(len(readers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return results


def assert_exactly_the_epoch(before: list[int], after: list[int]) -> None:
    assert sorted(before + after) == list(range(N)), (
        f"missing {sorted(set(range(N)) - set(before) - set(after))}, "
        f"repeated {sorted(x for x in set(after) if (before + after).count(x) > 1)}")


def test_three_readers_of_a_resumed_job_read_exactly_the_rest(shared_cluster) -> None:
    cluster = shared_cluster
    dataset_id = tds.register_dataset(cluster.target, tds.Pipeline.range(N).with_split_size(SPLIT))
    first = open_reader(cluster.target, dataset_id, "resume-before")
    before = take(first, 73)
    state = saved_state(cluster.target, first)
    first.close()
    data = state.to_data()
    assert len(data) == 1 and data[0]["complete"], data  # whole splits are ranges
    assert sum(e - s for s, e in data[0]["complete"]) * SPLIT + sum(
        b + len(x) for _, b, x in data[0]["partial"]) == 73
    restored = ConsumedSplits.from_data(data)
    readers = [open_reader(cluster.target, dataset_id, "resume-after", restored) for _ in range(3)]
    after = [x for part in read_together(readers) for x in part]
    assert_exactly_the_epoch(before, after)


def test_the_state_follows_what_was_yielded_not_what_the_service_produced(
        shared_cluster) -> None:
    cluster = shared_cluster
    dataset_id = tds.register_dataset(cluster.target, tds.Pipeline.range(N).with_split_size(SPLIT))
    first = open_reader(cluster.target, dataset_id, "resume-ahead", max_outstanding=16)
    before = take(first, 5)
    deadline = time.monotonic() + 10  # the workers produce, the reader prefetches ahead
    while first.stats()["elements"] < 40 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert first.stats()["elements"] >= 40
    state = saved_state(cluster.target, first)
    first.close()
    reader = open_reader(cluster.target, dataset_id, "resume-ahead-rest", state)
    assert_exactly_the_epoch(before, list(reader))


def test_a_resume_survives_dispatcher_restarts(cluster_factory, tmp_path: Path) -> None:
    work_dir = str(tmp_path / "work")
    cluster = cluster_factory(2, fault_tolerant_mode=True, work_dir=work_dir)
    dataset_id = tds.register_dataset(cluster.target, tds.Pipeline.range(N).with_split_size(SPLIT))
    first = open_reader(cluster.target, dataset_id, "saved")
    before = take(first, 47)
    state = ConsumedSplits.from_data(saved_state(cluster.target, first).to_data())
    first.close()

    def restart() -> None:
        port = cluster.dispatcher.port
        cluster.dispatcher.stop()
        cluster.dispatcher = tds.DispatchServer(tds.DispatcherConfig(
            host=HOST, port=port, fault_tolerant_mode=True, work_dir=work_dir))

    restart()  # between the save and the resume
    reader = open_reader(cluster.target, dataset_id, "resumed", state)
    after = take(reader, 20)
    restart()  # while the resumed job runs: its resume is replayed from the journal
    job = cluster.dispatcher._service.state.jobs[  # type: ignore[union-attr]
        cluster.dispatcher._service.state.job_by_name["resumed"]]  # type: ignore[union-attr]
    assert job.config.HasField("resume")
    after += list(reader)
    assert_exactly_the_epoch(before, after)

"""worker/tasks.py `_get_splits`: what a task's split fetch tells its replicas."""

from __future__ import annotations

from torch_dataservice.errors import ServiceUnavailableError
from torch_dataservice.proto import common_pb2
from torch_dataservice.worker import task_state as ts
from torch_dataservice.worker.tasks import _get_splits


class Unreachable:
    """A dispatcher client whose GetSplit retries ended unanswered."""

    split_cover_s = 0.0

    def __init__(self, stopping: bool) -> None:
        self.stopping = stopping

    def get_split(self, *args, **kwargs):
        raise ServiceUnavailableError("GetSplit: stopped after 0.5s")


FETCH = ts.FetchSplits(repetition=0, request_id=1, finished=[], max_splits=2)


def test_a_fetch_cut_short_by_the_workers_own_stop_fails_no_task() -> None:
    """Seen under load: a worker stopped while its GetSplit waited out a refusal sent
    "ServiceUnavailableError: GetSplit: stopped" to its readers, whose epoch then failed; a
    stopping worker's readers must see it leave, as any worker, and nothing else."""
    assert _get_splits(Unreachable(stopping=True), common_pb2.TaskDef(), FETCH) is None


def test_a_dispatcher_out_of_reach_fails_the_task_with_why() -> None:
    fetched = _get_splits(Unreachable(stopping=False), common_pb2.TaskDef(), FETCH)
    assert fetched is not None and fetched.splits == []
    assert fetched.error == ("ServiceUnavailableError", "GetSplit: stopped after 0.5s")

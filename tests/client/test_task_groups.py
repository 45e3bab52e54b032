"""The order in which a reader's fetch threads prefer tasks ("AUTO" prefers local workers)."""

from __future__ import annotations

from torch_dataservice.client.transports import task_groups
from torch_dataservice.proto import common_pb2
from torch_dataservice.wire import inprocess as local


def info(task_id: int, where: str) -> common_pb2.TaskInfo:
    host = local.HOST_ID if where in ("process", "host") else "elsewhere"
    process = local.process_id() if where == "process" else f"{host}:1"
    return common_pb2.TaskInfo(task_id=task_id, host_id=host, process_id=process)


def test_auto_ranks_this_process_then_this_host_then_remote() -> None:
    infos = [info(4005, "remote"), info(4001, "host"), info(4003, "process"),
             info(4002, "remote"), info(4004, "host")]
    assert task_groups(infos, "AUTO") == [[4003], [4001, 4004], [4002, 4005]]


def test_auto_with_only_remote_workers_reads_them_all() -> None:
    assert task_groups([info(4002, "remote"), info(4001, "remote")], "AUTO") == [[4001, 4002]]


def test_any_and_local_keep_one_group() -> None:
    infos = [info(4002, "remote"), info(4001, "process")]
    assert task_groups(infos, "ANY") == [[4001, 4002]]
    assert task_groups([info(4001, "host")], "LOCAL") == [[4001]]
    assert task_groups([], "AUTO") == []

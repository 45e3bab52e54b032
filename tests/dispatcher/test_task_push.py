"""Task pushes (dispatcher/task_push.py) to a real gRPC server: each push reaches it and leaves
no connection open behind it (a dispatcher sees thousands of worker addresses over its life)."""

from __future__ import annotations

import threading

import psutil
import pytest

from tests.conftest import wait_until
from torch_dataservice.dispatcher.task_push import TaskPusher
from torch_dataservice.proto import common_pb2, worker_pb2, worker_pb2_grpc
from torch_dataservice.serving import start_grpc_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


class Worker(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self) -> None:
        self.tasks: list[int] = []
        self.lock = threading.Lock()

    def ProcessTask(self, request, context):
        with self.lock:
            self.tasks.append(request.task.task_id)
        return worker_pb2.ProcessTaskResponse()


def _connections_to(port: int) -> int:
    return sum(1 for c in psutil.Process().net_connections("tcp")
               if c.raddr and c.raddr.port == port)


def test_every_push_arrives_and_no_connection_outlives_it() -> None:
    worker = Worker()
    server, port = start_grpc_server(
        lambda s: worker_pb2_grpc.add_WorkerServiceServicer_to_server(worker, s),
        "127.0.0.1", 0)
    pusher = TaskPusher()
    try:
        pusher.push((f"127.0.0.1:{port}", common_pb2.TaskDef(task_id=i)) for i in range(20))
        wait_until(lambda: len(worker.tasks) == 20, 20, "20 pushes to reach the worker")
        assert sorted(worker.tasks) == list(range(20))
        # A channel kept per address would keep its connection open until the process ends.
        wait_until(lambda: _connections_to(port) == 0, 10, "the pushes' connections to close")
    finally:
        pusher.close()
        server.stop(None)

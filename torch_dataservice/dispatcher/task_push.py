"""Best-effort pushes of new tasks to workers, off the dispatcher's lock.

A worker that misses a push gets the task in its next heartbeat reply, so a failed push is
only logged (DEBUG) and never retried here. Each push has a channel of its own, closed after
it: pushes are rare (a new task per worker), while workers come and go by the thousand over a
dispatcher's life, and a shared channel per address ever seen would hold its socket forever.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import grpc

from torch_dataservice.proto import common_pb2, worker_pb2, worker_pb2_grpc
from torch_dataservice.rpc import new_channel

logger = logging.getLogger(__name__)

Push = tuple[str, common_pb2.TaskDef]  # a task definition for a worker address
PUSH_TIMEOUT_S = 2


class TaskPusher:
    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="task-push")

    def push(self, pushes: Iterable[Push]) -> None:
        for address, task_def in pushes:
            self._pool.submit(_push_task, address, task_def)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _push_task(address: str, task_def: common_pb2.TaskDef) -> None:
    channel = new_channel(address)
    try:
        worker_pb2_grpc.WorkerServiceStub(channel).ProcessTask(
            worker_pb2.ProcessTaskRequest(task=task_def), timeout=PUSH_TIMEOUT_S)
    except grpc.RpcError as error:  # the next heartbeat delivers it
        logger.debug("push of task %d to %s failed: %s", task_def.task_id, address, error)
    finally:
        channel.close()

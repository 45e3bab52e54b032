"""A worker whose start fails half-way leaves nothing running."""

from __future__ import annotations

import socket
import time

import psutil
import pytest

import torch_dataservice as tds
from torch_dataservice.worker import launch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def test_a_worker_that_cannot_bind_its_port_stops_its_executors() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        me = psutil.Process()
        before = {child.pid for child in me.children(recursive=True)}
        with pytest.raises(OSError, match=f"could not bind 127.0.0.1:{port}"):
            tds.WorkerServer(tds.WorkerConfig("127.0.0.1:1", host="127.0.0.1", port=port,
                                              num_processes=2))
        # The process's fork server stays for its next worker (worker/launch.py): not an
        # executor.
        fork_server = launch.shared_fork_server().pid
        deadline = time.monotonic() + 10
        while True:
            left = [c for c in me.children(recursive=True)
                    if c.pid not in before and c.pid != fork_server and c.is_running()
                    and c.status() != psutil.STATUS_ZOMBIE]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not left, f"executor processes left running: {left}"

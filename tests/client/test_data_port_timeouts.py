"""The reader's data-port connections keep their receive timeout with kernel timeouts (blocking
sockets, MSG_WAITALL for big payloads): a worker that stalls mid-reply is given up."""

from __future__ import annotations

import os
import socket
import tempfile
import threading

import pytest

from torch_dataservice.client import data_port as client
from torch_dataservice.proto import worker_pb2
from torch_dataservice.wire.data_port import ACCEPTED, HELLO, LENGTH, OK, STATUS_LENGTH

pytestmark = pytest.mark.timeout(30)

PAYLOAD = 4 << 20  # big: received with MSG_WAITALL into a buffer of its own


def stalling_worker(listener: socket.socket, sent: int, done: threading.Event) -> None:
    """Accept one connection, answer one request with `sent` of PAYLOAD bytes, then stall."""
    conn, _ = listener.accept()
    with conn:
        _, _, token_length = HELLO.unpack(conn.recv(HELLO.size, socket.MSG_WAITALL))
        conn.recv(token_length, socket.MSG_WAITALL) if token_length else None
        conn.sendall(ACCEPTED)
        (size,) = LENGTH.unpack(conn.recv(LENGTH.size, socket.MSG_WAITALL))
        conn.recv(size, socket.MSG_WAITALL)
        header = worker_pb2.ElementBatchHeader()
        header.elements.add(offset=0, size=PAYLOAD)
        data = header.SerializeToString()
        conn.sendall(STATUS_LENGTH.pack(OK, len(data)) + data + b"x" * sent)
        done.wait(20)  # stall until the test is over


@pytest.mark.parametrize("kind", ["tcp", "unix"])
@pytest.mark.parametrize("sent", [0, 1 << 20])
def test_a_worker_stalling_mid_reply_times_out(kind: str, sent: int) -> None:
    directory = tempfile.mkdtemp()
    if kind == "tcp":
        listener = socket.create_server(("127.0.0.1", 0))
        target: tuple = ("tcp", "127.0.0.1", listener.getsockname()[1])
    else:
        path = os.path.join(directory, "data.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        target = ("unix", path)
    done = threading.Event()
    thread = threading.Thread(target=stalling_worker, args=(listener, sent, done), daemon=True)
    thread.start()
    connection = client.Connection(target, timeout_s=0.3)
    try:
        with pytest.raises(TimeoutError, match="did not answer within 0.3 s"):
            connection.fetch(worker_pb2.GetElementsRequest(task_id=1, max_elements=1))
    finally:
        done.set()
        connection.close()
        thread.join(5)
        listener.close()
        if kind == "unix":
            os.unlink(path)
        os.rmdir(directory)

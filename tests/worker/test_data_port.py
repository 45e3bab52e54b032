"""The worker's data port on its own: frames, statuses, tokens and shutdown (no dispatcher)."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest
import torch

from torch_dataservice import auth
from torch_dataservice.client import data_port as client
from torch_dataservice.proto import worker_pb2
from torch_dataservice.wire import codec
from torch_dataservice.wire.data_port import ACCEPTED, HELLO, LENGTH, OK, STATUS_LENGTH
from torch_dataservice.worker import data_port as data_port_module
from torch_dataservice.worker.data_port import DataPort

HOST = "127.0.0.1"
CHUNK = 1 << 20  # wire/frame.py's STREAM_CHUNK_BYTES: boundaries that broke streams before


def payload(size: int, seed: int) -> bytes:
    return (bytes(range(seed % 5, seed % 5 + 251)) * (size // 251 + 1))[:size]


class FakeWorker:
    """A fetch function serving the payloads queued for each task id."""

    def __init__(self) -> None:
        self.replies: dict[int, list] = {}
        self.ready = True

    def fetch(self, request: worker_pb2.GetElementsRequest):
        if request.task_id == 404:
            raise LookupError(request.task_id)
        if request.task_id == 500:
            raise ZeroDivisionError("boom")
        payloads = self.replies.get(request.task_id, [])
        header = worker_pb2.ElementBatchHeader(end_of_sequence=not payloads)
        for offset in range(len(payloads)):
            header.elements.add(offset=offset)
        return header, list(payloads)


@pytest.fixture
def worker():
    fake = FakeWorker()
    port = DataPort(fake.fetch, lambda: fake.ready, HOST)
    port.start()
    fake.port = port
    yield fake
    port.stop()


def targets(port: DataPort) -> list[tuple]:
    return [("tcp", HOST, port.port), ("unix", port.socket_path)]


def request(task_id: int) -> worker_pb2.GetElementsRequest:
    return worker_pb2.GetElementsRequest(task_id=task_id, max_elements=100)


@pytest.mark.parametrize("kind", ["tcp", "unix"])
def test_frames_of_every_size_arrive_intact(worker: FakeWorker, kind: str) -> None:
    sizes = [0, 1, client.OWN_BUFFER_BYTES - 1, client.OWN_BUFFER_BYTES, CHUNK - 7, CHUNK,
             CHUNK + 1, 0, 20 * 2**20, 3]
    sent = [payload(size, i) for i, size in enumerate(sizes)]
    # Payloads as the front holds them: bytes, and arrays over shared-memory segments.
    worker.replies[1] = [np.frombuffer(p, np.uint8) if i % 2 else p for i, p in enumerate(sent)]
    target = next(t for t in targets(worker.port) if t[0] == kind)
    connection = client.Connection(target)
    try:
        for _ in range(2):  # the connection serves request after request
            header, payloads = connection.fetch(request(1))
            assert [info.size for info in header.elements] == sizes
            assert [bytes(p) for p in payloads] == sent
            for p, size in zip(payloads, sizes, strict=True):
                if size >= client.OWN_BUFFER_BYTES:  # a buffer of its own, for decode to borrow
                    view = memoryview(p)
                    assert not view.readonly
                    assert np.frombuffer(view, np.uint8).ctypes.data % 16 == 0
        header, payloads = connection.fetch(request(2))
        assert header.end_of_sequence and payloads == []
    finally:
        connection.close()


def test_many_small_payloads_cross_the_receive_buffer(worker: FakeWorker) -> None:
    sent = [payload(1000 + i, i) for i in range(600)]  # ~900 KB: several receive buffers
    worker.replies[1] = sent
    connection = client.Connection(("tcp", HOST, worker.port.port))
    try:
        for _ in range(3):
            _, payloads = connection.fetch(request(1))
            assert payloads == sent
    finally:
        connection.close()


def test_decoded_tensors_borrow_the_received_buffer(worker: FakeWorker) -> None:
    tensor = torch.arange(5 << 20, dtype=torch.int32)
    parts = codec.encode({"t": tensor, "label": 3})
    worker.replies[1] = [b"".join(bytes(p) for p in parts)]
    pool = client.DataPortPool()
    try:
        _, payloads = pool.fetch(("unix", worker.port.socket_path), request(1))
        buffer = np.frombuffer(payloads[0], np.uint8)
        element = codec.decode(payloads[0], borrow=True)
        assert torch.equal(element["t"], tensor) and element["label"] == 3
        start = buffer.ctypes.data
        assert start <= element["t"].data_ptr() < start + buffer.nbytes  # no copy
    finally:
        pool.close()


@pytest.mark.parametrize("kind", ["tcp", "unix"])
def test_statuses_map_to_exceptions_and_keep_the_connection(worker: FakeWorker,
                                                            kind: str) -> None:
    worker.replies[1] = [b"x" * 10]
    pool = client.DataPortPool()
    target = next(t for t in targets(worker.port) if t[0] == kind)
    try:
        with pytest.raises(LookupError):
            pool.fetch(target, request(404))
        with pytest.raises(client.DataPortError, match="ZeroDivisionError: boom"):
            pool.fetch(target, request(500))
        worker.ready = False
        with pytest.raises(ConnectionError, match="not registered"):
            pool.fetch(target, request(1))
        worker.ready = True
        assert pool.fetch(target, request(1))[1] == [b"x" * 10]
        assert len(pool._idle[target]) == 1  # one connection, reused throughout
    finally:
        pool.close()


@pytest.mark.parametrize("client_token", [None, "wrong"])
def test_a_wrong_or_missing_token_is_refused(monkeypatch: pytest.MonkeyPatch,
                                             client_token: str | None) -> None:
    monkeypatch.setenv(auth.TOKEN_ENV, "s3cret")
    fake = FakeWorker()
    fake.replies[1] = [b"data"]
    port = DataPort(fake.fetch, lambda: True, HOST)
    port.start()
    try:
        for target in targets(port):
            assert client.Connection(target).fetch(request(1))[1] == [b"data"]
        if client_token is None:
            monkeypatch.delenv(auth.TOKEN_ENV)
        else:
            monkeypatch.setenv(auth.TOKEN_ENV, client_token)
        for target in targets(port):
            with pytest.raises(client.DataPortError, match="refused"):
                client.Connection(target)
    finally:
        port.stop()


def test_a_token_is_not_needed_by_a_worker_without_one(worker: FakeWorker,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(auth.TOKEN_ENV, "anything")
    worker.replies[1] = [b"data"]
    assert client.Connection(("tcp", HOST, worker.port.port)).fetch(request(1))[1] == [b"data"]


def test_garbage_is_disconnected(worker: FakeWorker) -> None:
    with socket.create_connection((HOST, worker.port.port), timeout=5) as sock:
        sock.sendall(HELLO.pack(b"HTTP", 1, 0))
        assert sock.recv(1) == b""  # closed, nothing answered


def test_stop_closes_connections_and_removes_the_socket_file() -> None:
    fake = FakeWorker()
    fake.replies[1] = [b"data"]
    port = DataPort(fake.fetch, lambda: True, HOST)
    port.start()
    path = port.socket_path
    assert os.path.exists(path)
    connection = client.Connection(("unix", path))
    assert connection.fetch(request(1))[1] == [b"data"]
    port.stop()
    assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))
    with pytest.raises((OSError, EOFError)):
        connection.fetch(request(1))
    connection.close()
    with pytest.raises(OSError):
        client.Connection(("tcp", HOST, port.port))


def test_a_non_loopback_host_needs_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    monkeypatch.delenv(auth.ALLOW_UNAUTHENTICATED_ENV, raising=False)
    with pytest.raises(ValueError, match="refusing to serve"):
        DataPort(FakeWorker().fetch, lambda: True, "0.0.0.0").start()


@pytest.mark.integration
def test_socket_directories_of_dead_workers_are_removed_at_start() -> None:
    import shutil
    import subprocess
    import sys
    import tempfile

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    root = tempfile.gettempdir()
    stale = tempfile.mkdtemp(prefix=f"tds-worker-{dead.pid}-", dir=root)
    alive = tempfile.mkdtemp(prefix=f"tds-worker-{os.getpid()}-", dir=root)
    # A pid unknown here whose socket is served: a worker of another pid namespace.
    elsewhere = tempfile.mkdtemp(prefix=f"tds-worker-{dead.pid}-", dir=root)
    served = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    served.bind(os.path.join(elsewhere, "data.sock"))
    served.listen(1)
    port = DataPort(FakeWorker().fetch, lambda: True, HOST)
    port.start()
    try:
        assert not os.path.exists(stale), "a dead worker's socket directory stayed"
        assert os.path.isdir(alive), "a live process's directory was removed"
        assert os.path.isdir(elsewhere), "a directory whose socket is served was removed"
        assert os.path.basename(os.path.dirname(port.socket_path)).startswith(
            f"tds-worker-{os.getpid()}-")
    finally:
        port.stop()
        os.rmdir(alive)
        served.close()
        shutil.rmtree(elsewhere)
    assert not os.path.exists(os.path.dirname(port.socket_path))


@pytest.mark.parametrize("kind", ["tcp", "unix"])
def test_a_reader_that_stops_reading_mid_reply_loses_its_connection(
        monkeypatch: pytest.MonkeyPatch, worker: FakeWorker, kind: str) -> None:
    # A reply goes out in one blocking sendmsg: its bound is the kernel's (SO_SNDTIMEO), which
    # must still cut a reader that stopped reading, freeing the worker's thread and payloads.
    monkeypatch.setattr(data_port_module, "SEND_TIMEOUT_S", 1.0)
    worker.replies[1] = [payload(64 << 20, 1)]  # far more than the socket buffers hold
    target = next(t for t in targets(worker.port) if t[0] == kind)
    connection = client.Connection(target)
    try:
        data = request(1).SerializeToString()
        connection._sock.sendall(LENGTH.pack(len(data)) + data)  # noqa: SLF001 (never reads)
        deadline = time.monotonic() + 15
        while worker.port._connections and time.monotonic() < deadline:  # noqa: SLF001
            time.sleep(0.1)
        assert not worker.port._connections  # noqa: SLF001
    finally:
        connection.close()


@pytest.mark.parametrize("kind", ["tcp", "unix"])
def test_a_worker_that_stalls_mid_reply_times_the_reader_out(tmp_path, kind: str) -> None:
    # The reader's socket blocks too (a payload in one recv with MSG_WAITALL): its bound is
    # SO_RCVTIMEO, and running out of it is a TimeoutError (the worker unreachable).
    family = socket.AF_UNIX if kind == "unix" else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "s") if kind == "unix" else (HOST, 0))
    listener.listen(1)
    target = (("unix", str(tmp_path / "s")) if kind == "unix"
              else ("tcp", HOST, listener.getsockname()[1]))

    def stall() -> None:
        conn, _ = listener.accept()
        with conn:
            _, _, length = HELLO.unpack(conn.recv(HELLO.size, socket.MSG_WAITALL))
            conn.recv(length, socket.MSG_WAITALL)
            conn.sendall(ACCEPTED)
            (size,) = LENGTH.unpack(conn.recv(LENGTH.size, socket.MSG_WAITALL))
            conn.recv(size, socket.MSG_WAITALL)
            header = worker_pb2.ElementBatchHeader()
            header.elements.add(offset=0, size=1 << 20)
            head = header.SerializeToString()
            conn.sendall(STATUS_LENGTH.pack(OK, len(head)) + head + bytes(1000))
            done.wait(10)

    done = threading.Event()
    thread = threading.Thread(target=stall, daemon=True)
    thread.start()
    connection = client.Connection(target, timeout_s=0.5)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            connection.fetch(request(1))
        assert time.monotonic() - started < 5
    finally:
        done.set()
        connection.close()
        listener.close()
        thread.join(5)


def eventually(condition, timeout_s: float = 5.0) -> bool:
    """Whether `condition()` holds within `timeout_s` (segments go back on another thread)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def segment_payloads(sizes: list[int], freed: list[int]) -> tuple[list, list[bytes]]:
    """Payloads over real memfd segments (as the front holds an executor's), with what they
    hold; `freed` collects the segments given back."""
    from torch_dataservice.worker import shm

    segments = shm.SegmentMap(freed.append)
    payloads, expected = [], []
    for number, size in enumerate(sizes):
        fd = os.memfd_create(f"test-{number}")
        data = payload(size, number)
        os.pwrite(fd, data, 0)
        segments.add(number, fd, size)
        payloads.append(segments.payload(number, size))
        expected.append(data)
    return payloads, expected


def pieced(parts: list[bytes | tuple[bytes, int]]) -> tuple[object, bytes]:
    """A PiecedPayload of bytes pieces and pieces of files (data, offset into a file)."""
    from torch_dataservice.worker import shm

    pieces: list = []
    whole = b""
    for part in parts:
        if isinstance(part, bytes):
            pieces.append(part)
            whole += part
            continue
        data, at = part
        fd = os.memfd_create("test-piece")
        os.pwrite(fd, b"\xee" * at + data + b"\xee" * 100, 0)
        pieces.append((shm.SegmentFile(fd), at, len(data)))
        whole += data
    return shm.PiecedPayload(pieces, len(whole)), whole


@pytest.mark.parametrize("kind", ["tcp", "unix"])
def test_payloads_from_files_arrive_intact(worker: FakeWorker, kind: str) -> None:
    """Segments and pieced payloads go by sendfile, between bytes sent by sendmsg."""
    freed: list[int] = []
    segments, expected = segment_payloads([3 << 20, 5], freed)
    big = payload(2 << 20, 7)
    pieced_one, whole = pieced([b"head" * 5, (big, 4096 + 16), b"mid", (big[:70000], 3)])
    worker.replies[1] = [segments[0], b"small", pieced_one, segments[1]]
    del segments, pieced_one
    target = next(t for t in targets(worker.port) if t[0] == kind)
    connection = client.Connection(target)
    try:
        header, payloads = connection.fetch(request(1))
        assert [bytes(p) for p in payloads] == [expected[0], b"small", whole, expected[1]]
        assert [info.size for info in header.elements] == [len(p) for p in payloads]
    finally:
        connection.close()


def test_a_reply_sent_by_sendfile_is_held_until_the_reader_asks_again(
        worker: FakeWorker) -> None:
    """sendfile hands the kernel the segment's pages, which the reader copies later: the
    segment must not go back to the executor (to be overwritten) before the reader has read
    the reply, i.e. before it asks again on that connection or closes it."""
    freed: list[int] = []
    payloads, _ = segment_payloads([2 << 20, 2 << 20], freed)
    worker.replies[1] = [payloads[0]]
    worker.replies[2] = [payloads[1]]
    del payloads
    connection = client.Connection(("tcp", HOST, worker.port.port))
    try:
        connection.fetch(request(1))
        worker.replies[1] = []  # the fake's references go: only the connection holds it
        time.sleep(0.2)  # room for a wrong early release to happen (none must)
        assert freed == []  # sent, but held: the reader has not asked again
        connection.fetch(request(2))
        assert eventually(lambda: freed == [0])  # asked again: the first reply's segment goes back
        worker.replies[2] = []
    finally:
        connection.close()
    assert eventually(lambda: sorted(freed) == [0, 1])  # closed: the last one goes back too


def test_held_replies_are_bounded(worker: FakeWorker, monkeypatch) -> None:
    """Past HELD_BYTES held in all, a reply is copied into the socket and not held."""
    monkeypatch.setattr(data_port_module, "HELD_BYTES", 3 << 20)
    freed: list[int] = []
    payloads, expected = segment_payloads([2 << 20, 2 << 20], freed)
    worker.replies[1] = [payloads[0]]
    worker.replies[2] = [payloads[1]]
    del payloads
    first = client.Connection(("tcp", HOST, worker.port.port))
    second = client.Connection(("tcp", HOST, worker.port.port))
    try:
        assert bytes(first.fetch(request(1))[1][0]) == expected[0]
        worker.replies[1] = []
        assert bytes(second.fetch(request(2))[1][0]) == expected[1]
        worker.replies[2] = []
        # over the bound: copied, so not held; the first one still is
        assert eventually(lambda: freed == [1])
    finally:
        first.close()
        second.close()

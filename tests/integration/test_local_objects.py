"""A worker whose pipelines run on threads of this process (`num_processes=0`) hands its
elements to in-process readers as the objects the pipeline produced: no encode, no copy, no
decode (wire/inprocess.py). A reader elsewhere (data port, gRPC) and the cross-trainer cache get
them encoded, with the job's compression; credits still bound the objects in flight.

The pipelines' functions live in this importable module, pickled by reference, so the worker's
threads record what they produce in `PRODUCED`, the very dict the test reads.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import torch_dataservice as tds
from tests.conftest import wait_until
from torch_dataservice.client import transports as reader_module
from torch_dataservice.errors import RemoteError
from torch_dataservice.wire import codec
from torch_dataservice.worker import executor_process

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

BIG = 3 << 20  # above the shared-memory threshold an executor process would use
N = 12
PRODUCED: dict[tuple[str, int], Any] = {}
_produced_lock = threading.Lock()


def produce(tag: str, i: int) -> dict:
    """Odd elements big, even ones small; each recorded under (tag, i)."""
    element = {"i": i, "data": torch.full((BIG if i % 2 else 16,), i % 251, dtype=torch.uint8)}
    with _produced_lock:
        PRODUCED[(tag, i)] = element
    return element


def zeros(i: int) -> torch.Tensor:
    return torch.zeros(2 << 20, dtype=torch.uint8)  # compresses to almost nothing


def unpicklable(i: int) -> dict:
    return {"i": i, "lock": threading.Lock()}


def check_values(received: list[dict]) -> None:
    assert sorted(e["i"] for e in received) == list(range(N))
    for e in received:
        assert e["data"].numel() == (BIG if e["i"] % 2 else 16)
        assert bool((e["data"] == e["i"] % 251).all())


def read(target: str, tag: str, target_workers: str, **options: Any) -> list:
    return list(tds.Pipeline.range(N).map(functools.partial(produce, tag)).apply(
        tds.distribute("parallel_epochs", target, target_workers=target_workers,
                       job_name=f"{tag}-{target_workers}", **options)))


@pytest.fixture(autouse=True)
def _clear_produced() -> Iterator[None]:
    PRODUCED.clear()
    yield
    PRODUCED.clear()


@pytest.fixture
def codec_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often elements were encoded (anywhere) and decoded (by readers)."""
    calls = {"encode": 0, "decode": 0}
    real_encode, real_decode = codec.encode, codec.decode

    def encode(*args: Any, **kwargs: Any) -> Any:
        calls["encode"] += 1
        return real_encode(*args, **kwargs)

    def decode(*args: Any, **kwargs: Any) -> Any:
        calls["decode"] += 1
        return real_decode(*args, **kwargs)

    monkeypatch.setattr(codec, "encode", encode)
    monkeypatch.setattr(codec, "decode", decode)
    return calls


@pytest.fixture
def data_port_payloads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple, list[int]]]:
    """(target, payload sizes) of every data port reply the readers received."""
    replies: list[tuple[tuple, list[int]]] = []
    real = reader_module.DataPortPool.fetch

    def recording(self: Any, target: tuple, request: Any, on_header: Any = None) -> Any:
        header, payloads = real(self, target, request, on_header)
        replies.append((target, [memoryview(p).nbytes for p in payloads]))
        return header, payloads

    monkeypatch.setattr(reader_module.DataPortPool, "fetch", recording)
    return replies


def test_local_reads_get_the_produced_objects_without_encoding(
        cluster_factory, codec_calls: dict[str, int]) -> None:
    cluster = cluster_factory(1, num_processes=0)
    # Compression is the job's setting for the wire: it does not apply to objects.
    received = read(cluster.target, "local", "LOCAL", compression="AUTO")
    check_values(received)
    assert all(e is PRODUCED[("local", e["i"])] for e in received)
    assert codec_calls == {"encode": 0, "decode": 0}


def test_any_reads_of_the_same_worker_get_encoded_copies(
        cluster_factory, codec_calls: dict[str, int],
        data_port_payloads: list[tuple[tuple, list[int]]]) -> None:
    cluster = cluster_factory(1, num_processes=0)
    results: dict[str, list] = {}
    errors: list[BaseException] = []

    def run(tag: str, target_workers: str) -> None:
        try:
            results[tag] = read(cluster.target, tag, target_workers, compression=None)
        except BaseException as error:  # reported by the test thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=("local", "LOCAL")),
               threading.Thread(target=run, args=("any", "ANY"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    run("after", "ANY")  # and once the LOCAL reader is gone
    assert not errors, errors
    for tag in ("local", "any", "after"):
        check_values(results[tag])
    assert all(e is PRODUCED[("local", e["i"])] for e in results["local"])
    for tag in ("any", "after"):
        assert not any(e is PRODUCED[(tag, e["i"])] for e in results[tag])
    assert codec_calls["encode"] == codec_calls["decode"] == 2 * N  # the ANY elements only
    port = cluster.workers[0]._data_port.port  # noqa: SLF001
    assert {target for target, _ in data_port_payloads} == {("tcp", "127.0.0.1", port)}


def test_any_reads_over_grpc_get_correct_values(
        cluster_factory, monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = cluster_factory(1, num_processes=0)
    streamed: list[str] = []
    real = reader_module.frame.assemble_frame

    def recording(call: Any) -> Any:
        streamed.append("StreamElements")
        return real(call)

    # Without a data port the network path is gRPC StreamElements.
    monkeypatch.setattr(reader_module, "data_target", lambda info, target_workers: None)
    monkeypatch.setattr(reader_module.frame, "assemble_frame", recording)
    received = read(cluster.target, "grpc", "ANY", compression="AUTO")
    check_values(received)
    assert not any(e is PRODUCED[("grpc", e["i"])] for e in received)
    assert streamed


@pytest.mark.parametrize("compression", ["AUTO", None])
def test_compression_applies_to_remote_reads(
        cluster_factory, compression: str | None,
        data_port_payloads: list[tuple[tuple, list[int]]]) -> None:
    cluster = cluster_factory(1, num_processes=0)
    pipeline = tds.Pipeline.range(4).map(zeros).apply(tds.distribute(
        "parallel_epochs", cluster.target, compression=compression, target_workers="ANY"))
    received = list(pipeline)
    assert len(received) == 4 and all(not t.any() and t.numel() == 2 << 20 for t in received)
    sizes = [size for _, reply in data_port_payloads for size in reply]
    assert len(sizes) == 4
    if compression is None:
        assert min(sizes) >= 2 << 20
    else:
        assert max(sizes) < (2 << 20) // 10


@pytest.mark.timeout(120)
def test_mixed_local_and_remote_fetches_of_one_task_are_exactly_once(
        cluster_factory, monkeypatch: pytest.MonkeyPatch,
        data_port_payloads: list[tuple[tuple, list[int]]]) -> None:
    cluster = cluster_factory(1, num_processes=0)
    real_choose = reader_module.choose
    direct: list[int] = []

    class Alternating:
        """Every other fetch of the task through the data port (encoded), the others
        in-process: a reader's transport is chosen once per task, so this mixes them."""

        network = borrow = True

        def __init__(self, info, target_workers, pool, shared) -> None:
            self._local = real_choose(info, target_workers, pool, shared)
            self._remote = real_choose(info, "ANY", pool, shared)
            self._fetches = 0

        def fetch(self, request):
            self._fetches += 1
            if self._fetches % 2:
                return self._remote.fetch(request)
            direct.append(1)
            return self._local.fetch(request)

    monkeypatch.setattr(reader_module, "choose", Alternating)
    n = 2000
    pipeline = tds.Pipeline.range(n).with_split_size(25).apply(tds.distribute(
        "distributed_epoch", cluster.target, max_outstanding_requests=2))
    received = list(pipeline)
    assert sorted(received) == list(range(n))
    assert direct and data_port_payloads


ELEMENT_BYTES = 8 << 20


def bounded(i: int) -> torch.Tensor:
    with _produced_lock:
        PRODUCED[("bounded", i)] = None  # no reference kept: only the count matters
    return torch.full((ELEMENT_BYTES,), 1, dtype=torch.uint8)


def test_objects_in_flight_are_bounded_by_bytes(cluster_factory) -> None:
    cluster = cluster_factory(1, num_processes=0)
    pipeline = tds.Pipeline.range(40).map(bounded).apply(tds.distribute(
        "parallel_epochs", cluster.target, target_workers="LOCAL", compression=None,
        max_outstanding_requests=1))
    iterator = iter(pipeline)
    try:
        assert int(next(iterator)[0]) == 1
        # A few are made ahead of the consumer, then the byte bound stops the pipeline: the
        # worker holds MAX_BYTES_IN_FLIGHT of them, the reader one fetch, the consumer one.
        wait_until(lambda: len(PRODUCED) >= 4, 30, "elements made ahead of the consumer")
        time.sleep(1.0)
        ahead = executor_process.MAX_BYTES_IN_FLIGHT // ELEMENT_BYTES
        assert 4 <= len(PRODUCED) <= ahead + 4, len(PRODUCED)
    finally:
        iterator.close()


def test_a_cross_trainer_cache_gives_each_trainer_its_own_copy(cluster_factory) -> None:
    cluster = cluster_factory(1, num_processes=0)

    def take(trainer_id: str, n: int) -> list:
        pipeline = tds.Pipeline.range(10**9).map(functools.partial(produce, "cache")).apply(
            tds.distribute("parallel_epochs", cluster.target, job_name="cache",
                           cross_trainer_cache=tds.CrossTrainerCache(trainer_id)))
        iterator = iter(pipeline)
        try:
            return [next(iterator) for _ in range(n)]
        finally:
            iterator.close()

    a = take("a", 6)
    for element in a:
        element["data"] += 1  # a trainer may change what it received
    b = take("b", 6)
    assert [e["i"] for e in a] == [e["i"] for e in b] == list(range(6))
    for x, y in zip(a, b, strict=True):
        assert x is not y and x["data"] is not y["data"]
        assert bool((y["data"] == y["i"] % 251).all())
        assert bool((x["data"] == (x["i"] + 1) % 256).all())


def test_an_unpicklable_element_reaches_local_readers_and_fails_remote_ones(
        cluster_factory) -> None:
    cluster = cluster_factory(1, num_processes=0)

    def pipeline(target_workers: str) -> tds.Pipeline:
        return tds.Pipeline.range(3).map(unpicklable).apply(tds.distribute(
            "parallel_epochs", cluster.target, target_workers=target_workers))

    received = list(pipeline("LOCAL"))  # as with DataLoader(num_workers=0): any object
    assert sorted(e["i"] for e in received) == [0, 1, 2]
    with pytest.raises(RemoteError, match="pickle"):
        list(pipeline("ANY"))


def first_unpicklable(i: int) -> dict:
    return unpicklable(i) if i == 0 else {"i": i}


def test_an_element_a_remote_reader_cannot_get_fails_the_task_for_every_reader(
        cluster_factory) -> None:
    cluster = cluster_factory(1, num_processes=0)

    def reader() -> Iterator[Any]:
        return iter(tds.Pipeline.range(1000).map(first_unpicklable).apply(tds.distribute(
            "parallel_epochs", cluster.target, target_workers="ANY",
            job_name="shared-unpicklable", max_outstanding_requests=1)))

    with pytest.raises(RemoteError, match="pickle"):
        next(reader())
    # Element 0 (and what else that fetch took) is gone with the error: the task is failed
    # for all of its readers, not left serving the rest without them.
    with pytest.raises(RemoteError, match="pickle"):
        for _ in reader():
            pass


class Opaque:
    """An object the size estimate cannot see into (no __dict__), like a C extension's."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


def opaque(i: int) -> Opaque:
    with _produced_lock:
        PRODUCED[("opaque", i)] = None
    return Opaque(i)


def test_objects_in_flight_are_bounded_in_number_too(cluster_factory) -> None:
    cluster = cluster_factory(1, num_processes=0)
    pipeline = tds.Pipeline.range(10_000).map(opaque).apply(tds.distribute(
        "parallel_epochs", cluster.target, target_workers="LOCAL", compression=None,
        max_outstanding_requests=1))
    iterator = iter(pipeline)
    try:
        assert next(iterator).i == 0
        wait_until(lambda: len(PRODUCED) >= executor_process.LOCAL_CREDITS, 30,
                   "elements made ahead of the consumer")
        time.sleep(1.0)
        # The credits stop the pipeline: the worker holds LOCAL_CREDITS, the reader one fetch.
        made = len(PRODUCED)
        assert made <= 2 * executor_process.LOCAL_CREDITS + 1, made
    finally:
        iterator.close()

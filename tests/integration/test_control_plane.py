"""The control plane under load, on real servers: peers report at the interval the dispatcher
asks for; past its capacity it refuses with a retry-after and readers still finish, exactly once;
acknowledgements reach the journal as ranges."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

import torch_dataservice as tds
from tests.conftest import subprocess_env, wait_until
from tests.dispatcher.builders import replayed_updates
from tests.observability.test_metrics import scrape
from torch_dataservice import rpc
from torch_dataservice.client.membership import Membership
from torch_dataservice.dispatcher import server as dispatcher_server
from torch_dataservice.errors import GRPC_REFUSAL_RETRY_AFTER_MS
from torch_dataservice.observability.status_text import as_text
from torch_dataservice.policies import ShardingPolicy
from torch_dataservice.proto import common_pb2
from torch_dataservice.serving import Queue, start_grpc_server

pytestmark = pytest.mark.integration

N = 1200


def read_together(target: str, job_name: str, readers: int) -> list[list[int]]:
    """`readers` readers sharing one DYNAMIC job; what each yielded."""
    out: list[list[int]] = [[] for _ in range(readers)]
    errors: list[BaseException] = []

    def read(index: int) -> None:
        try:
            out[index] = list(tds.Pipeline.range(N).with_split_size(20).apply(tds.distribute(
                "distributed_epoch", target, job_name=job_name, target_workers="ANY")))
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(readers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert not any(t.is_alive() for t in threads), "a reader did not finish"
    assert not errors, errors
    return out


def assert_exactly_once(parts: list[list[int]]) -> None:
    read = sorted(x for part in parts for x in part)
    assert read == list(range(N)), f"{len(read)} elements, {len(set(read))} distinct"


@pytest.mark.timeout(60)
def test_workers_and_readers_report_at_the_interval_the_dispatcher_asks(cluster_factory) -> None:
    # A budget of 2 heartbeats/s for 1 worker + 1 reader (12/s at the default intervals):
    # the dispatcher stretches both intervals sixfold: 3 s and 600 ms.
    cluster = cluster_factory(num_workers=1, heartbeat_budget_rps=2, metrics_port=0)
    dataset_id = tds.register_dataset(cluster.target, tds.Pipeline.range(N))
    membership = Membership(cluster.address, common_pb2.JobConfig(
        dataset_id=dataset_id, job_name="paced", sharding_policy=int(ShardingPolicy.DYNAMIC),
        target_workers="ANY"), 0, 10, "ANY", None)
    beating = threading.Thread(target=membership.heartbeat_loop, daemon=True)
    beating.start()
    service = cluster.dispatcher._service  # noqa: SLF001 (introspection)
    worker = cluster.workers[0]
    try:
        wait_until(lambda: membership.interval_s == 0.6
                   and worker._heartbeat.interval_s == 3.0,  # noqa: SLF001
                   15, "the reader and the worker to take the intervals asked")
        calls = dict(service._observe.calls)  # noqa: SLF001
        time.sleep(3.0)
        now = dict(service._observe.calls)  # noqa: SLF001
        client_beats = now["ClientHeartbeat"] - calls["ClientHeartbeat"]
        worker_beats = now["WorkerHeartbeat"] - calls["WorkerHeartbeat"]
        # At their own intervals they would have sent 30 (100 ms) and 30 (100 ms) in 3 s.
        assert 2 <= client_beats <= 8, client_beats
        assert worker_beats <= 2, worker_beats
        status = cluster.dispatcher._service.cluster_status()  # noqa: SLF001
        assert (status.load.worker_heartbeat_ms, status.load.client_heartbeat_ms) == (3000, 600)
        assert "workers 3s, readers 0.6s" in as_text(status, cluster.address)
        samples = scrape(cluster.dispatcher.metrics_port)
        assert samples[("tds_dispatcher_heartbeat_interval_seconds",
                        (("peer", "client"),))] == pytest.approx(0.6)
        # A reader joining now starts at the interval in force, told in its join reply.
        late = Membership(cluster.address, common_pb2.JobConfig(
            dataset_id=dataset_id, job_name="paced", sharding_policy=int(ShardingPolicy.DYNAMIC),
            target_workers="ANY"), 0, 10, "ANY", None)
        assert late.interval_s == 0.6
        late.release()
    finally:
        membership.closed.set()
        beating.join(5)
        membership.release()


@pytest.mark.timeout(60)
def test_a_reader_of_a_pipeline_reports_at_the_interval_the_dispatcher_asks(
        cluster_factory) -> None:
    """The reader a user gets (tds.distribute), not a bare Membership: it beats at the
    interval asked, and a gap between its answered heartbeats that is as long as asked is
    no pause (no extra heartbeat before the next element)."""
    cluster = cluster_factory(num_workers=1, heartbeat_budget_rps=2)
    service = cluster.dispatcher._service  # noqa: SLF001 (introspection)
    elements = iter(tds.Pipeline.range(10**6).apply(tds.distribute(
        "distributed_epoch", cluster.target, job_name="paced-reader")))
    try:
        next(elements)
        # 1 worker + 1 reader at a budget of 2/s: readers 600 ms (as in the test above).
        wait_until(lambda: service.cadence.client_ms == 600, 15, "the readers' interval")
        time.sleep(1.0)  # the reader has the interval from a reply since
        calls = service._observe.calls["ClientHeartbeat"]  # noqa: SLF001
        began = time.monotonic()
        while time.monotonic() - began < 3.0:  # a steady consumer: an element every 10 ms
            next(elements)
            time.sleep(0.01)
        beats = service._observe.calls["ClientHeartbeat"] - calls  # noqa: SLF001
    finally:
        elements.close()
    # 5 in 3 s at 600 ms; 30 at the reader's own 100 ms; 10 with one more after every gap
    # past 0.5 s (reader.PAUSE_S) taken for a pause.
    assert 3 <= beats <= 7, beats


def read_while_held(hold: Callable[[], None], target: str, job: str, caplog) -> list:
    """3 readers share `job` while a thread calls `hold` (it keeps the dispatcher busy for a
    while) every 0.15 s; rpc's warnings are captured."""
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            hold()
            time.sleep(0.15)

    hog = threading.Thread(target=busy, daemon=True)
    hog.start()
    try:
        with caplog.at_level(logging.WARNING, logger="torch_dataservice.rpc"):
            return read_together(target, job, readers=3)
    finally:
        stop.set()
        hog.join(5)


@pytest.mark.timeout(120)
def test_an_overloaded_dispatcher_refuses_and_its_readers_back_off_and_finish(
        cluster_factory, caplog, monkeypatch) -> None:
    cluster = cluster_factory(num_workers=2, max_pending_rpcs=2)
    service = cluster.dispatcher._service  # noqa: SLF001 (introspection)
    monkeypatch.setattr(rpc, "_overload_logged", False)

    def long_handler() -> None:
        """A long handler: it holds the dispatcher, admitted, while requests arrive."""
        with service._lock:  # noqa: SLF001
            service.cadence.admit("GetOrRegisterDataset")
            try:
                time.sleep(0.15)
            finally:
                service.cadence.done()

    parts = read_while_held(long_handler, cluster.target, "overloaded", caplog)
    assert_exactly_once(parts)
    assert service.cadence.refused > 0
    refusals = [r for r in caplog.records if "over its capacity" in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in refusals]  # logged once


CALLER = """
import sys, grpc
from torch_dataservice.errors import retry_after_ms
call = grpc.insecure_channel(sys.argv[1]).unary_unary("/probe.Probe/Call")
call(b"", timeout=10)
print("ready", flush=True)
sys.stdin.readline()  # the server's Python is starved from now on
futures = [call.future(b"", timeout=10) for _ in range(20)]
cancelled = call.future(b"", timeout=10)
cancelled.cancel()  # by the caller: no overload
codes = []
for future in [*futures, cancelled]:
    try:
        future.result()
        codes.append("OK")
    except grpc.FutureCancelledError:
        codes.append("LOCAL")
    except grpc.RpcError as error:
        codes.append(f"{error.code().name}/{retry_after_ms(error)}")
print(" ".join(codes), flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("queue", [None, Queue(pending=1, pending_hard=2, pending_s=1,
                                               max_concurrent=64)], ids=["grpc", "bounded"])
def test_requests_wait_in_grpcs_core_only_as_long_as_the_queue_allows(queue) -> None:
    # While the server's Python cannot run (here: this thread keeps the GIL), requests wait
    # in gRPC's core, where no handler sees them: gRPC's defaults keep them all (seconds of
    # latency), the dispatcher's bounds (dispatcher/server.py QUEUE) drop the excess at once.
    handler = grpc.method_handlers_generic_handler(
        "probe.Probe", {"Call": grpc.unary_unary_rpc_method_handler(lambda r, c: b"")})
    server, port = start_grpc_server(lambda s: s.add_generic_rpc_handlers((handler,)),
                                     "127.0.0.1", 0, queue=queue)
    caller = subprocess.Popen([sys.executable, "-c", CALLER, f"127.0.0.1:{port}"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=subprocess_env())
    try:
        assert caller.stdout.readline().strip() == "ready"
        interval = sys.getswitchinterval()
        sys.setswitchinterval(100)
        try:
            # Starved before the requests are sent (a sleep here let the server's Python
            # serve some first: a flaky count of drops), and for 2.5 s while they arrive.
            caller.stdin.write("go\n")
            caller.stdin.flush()
            end = time.monotonic() + 2.5
            while time.monotonic() < end:  # keeps the GIL: gRPC's server thread waits
                pass
        finally:
            sys.setswitchinterval(interval)
        codes = caller.stdout.readline().split()
    finally:
        caller.kill()
        caller.wait(10)
        server.stop(None)
    assert len(codes) == 21 and codes[-1] == "LOCAL", codes
    if queue is None:
        assert set(codes[:-1]) == {"OK"}, codes  # all waited
    else:  # dropped, not kept waiting, and waited out as an overload by the callers
        assert codes.count(f"CANCELLED/{GRPC_REFUSAL_RETRY_AFTER_MS}") >= 5, codes


@pytest.mark.timeout(120)
def test_a_full_grpc_queue_is_refused_by_grpc_and_readers_back_off_and_finish(
        cluster_factory, caplog, monkeypatch) -> None:
    # Room for 2 requests past gRPC's core, and no refusal by the handlers: a hog holding the
    # dispatcher makes requests pile up, and gRPC itself refuses the rest (no hint comes with
    # that): peers must take it for overload, not for an error.
    monkeypatch.setattr(dispatcher_server, "QUEUE",
                        Queue(pending=1, pending_hard=1, pending_s=1, max_concurrent=2))
    cluster = cluster_factory(num_workers=2, max_pending_rpcs=1000)
    service = cluster.dispatcher._service  # noqa: SLF001 (introspection)
    monkeypatch.setattr(rpc, "_overload_logged", False)

    def hold() -> None:
        with service._lock:  # noqa: SLF001
            time.sleep(0.15)

    parts = read_while_held(hold, cluster.target, "grpc-queue", caplog)
    assert_exactly_once(parts)
    assert service.cadence.refused == 0  # the handlers refused nothing: gRPC did
    refusals = [r.getMessage() for r in caplog.records if "over its capacity" in r.getMessage()]
    assert refusals and f"retry after {GRPC_REFUSAL_RETRY_AFTER_MS} ms" in refusals[0], refusals


@pytest.mark.timeout(90)
def test_acknowledgements_reach_the_journal_as_ranges_and_the_read_is_exactly_once(
        cluster_factory, tmp_path: Path) -> None:
    cluster = cluster_factory(num_workers=2, fault_tolerant_mode=True, work_dir=str(tmp_path))
    assert_exactly_once(read_together(cluster.target, "ranges", readers=3))
    cluster.stop()
    reports = [r for u in replayed_updates(tmp_path) if u.WhichOneof("kind") == "record_delivered"
               for r in u.record_delivered.splits]
    assert reports and all(r.offset_ranges and not r.offsets for r in reports)
    acknowledged = sum(b - a for r in reports
                       for a, b in zip(r.offset_ranges[::2], r.offset_ranges[1::2], strict=True))
    integers = sum(len(r.offset_ranges) for r in reports)
    assert acknowledged >= N - 3 * 20 and integers < acknowledged / 2, (acknowledged, integers)

"""The heartbeat economy with no servers: intervals sized to the fleet and told in replies,
liveness timeouts that grow with them, admission past capacity, acknowledgements as ranges."""

from __future__ import annotations

import grpc
import pytest

from tests.dispatcher.builders import (
    Clock,
    Context,
    client_request,
    get_split,
    heartbeat_worker,
    make_service,
    start_epoch,
    task_of,
)
from torch_dataservice import rpc
from torch_dataservice.client.membership import Membership
from torch_dataservice.dispatcher import cadence
from torch_dataservice.errors import GRPC_REFUSAL_RETRY_AFTER_MS, is_retryable, retry_after_ms
from torch_dataservice.proto import common_pb2, dispatcher_pb2
from torch_dataservice.wire.splits import index_ranges

pb = dispatcher_pb2


def grow(service, workers: int, clients: int, job_id: int | None = None) -> None:
    for i in range(workers):
        heartbeat_worker(service, f"worker-{i}:1")
    for _ in range(clients):
        service.GetOrCreateIteration(pb.GetOrCreateIterationRequest(job_id=job_id), None)


def test_small_fleets_keep_their_own_intervals_and_big_ones_report_less_often() -> None:
    assert cadence.population_stretch(10, 10, 500) == 1.0
    assert cadence.interval_ms(cadence.CLIENT_DEFAULT_S, 1.0, 10.0) == 0  # 0: peer's default
    stretches = [cadence.population_stretch(n, 4 * n, 500) for n in (50, 200, 1000)]
    assert stretches == sorted(stretches) and stretches[0] > 1.0
    # Within the budget wherever the caps allow it.
    s = cadence.population_stretch(100, 400, 500)
    assert 100 / (0.5 * s) + 400 / (0.1 * s) == pytest.approx(500, rel=1e-3)
    assert cadence.interval_ms(cadence.WORKER_DEFAULT_S, 1e6, 5.0) == 5000  # capped


def test_the_reply_tells_an_interval_that_grows_with_the_population() -> None:
    clock = Clock()
    service = make_service(clock)
    iteration_id, client = start_epoch(service, workers=())
    job_id = service.state.iteration(iteration_id).job_id
    asked = []
    for workers, clients in ((10, 10), (200, 200), (1000, 1000)):
        grow(service, workers - len(service.state.workers),
             clients - len(service.state.clients), job_id)
        service.check_liveness()  # re-sizes the intervals
        worker_ms = heartbeat_worker(service, "worker-0:1").next_heartbeat_ms
        client_ms = service.ClientHeartbeat(client_request(service, client),
                                            None).next_heartbeat_ms
        asked.append((worker_ms, client_ms))
    assert asked[0] == (0, 0)  # 10 + 10: today's intervals, today's reaction
    # A reader joining a big fleet starts at the stretched interval, not at 100 ms: thousands
    # joining at once do not all beat at the default until their first reply.
    joined = service.GetOrCreateIteration(pb.GetOrCreateIterationRequest(job_id=job_id), None)
    assert joined.next_heartbeat_ms == asked[2][1]
    assert 0 < asked[1][0] < asked[2][0] and 0 < asked[1][1] < asked[2][1]
    load = service.cluster_status().load
    assert (load.worker_heartbeat_ms, load.client_heartbeat_ms) == asked[2]
    service.close()


def test_a_dead_worker_is_noticed_within_30_s_at_1000_workers_and_as_fast_as_ever_at_10() -> None:
    for workers, latest in ((10, 1.0), (1000, 30.0)):
        clock = Clock()
        service = make_service(clock, worker_timeout_ms=1000)
        grow(service, workers, 0)
        service.check_liveness()
        interval = service.cadence.worker_ms / 1000 or 0.5
        dead = "worker-0:1"
        addresses = sorted(service.state.workers)
        # Each live worker reports once per interval, at its own phase.
        due = {a: i * interval / len(addresses) for i, a in enumerate(addresses) if a != dead}
        noticed = None
        while noticed is None and clock.now < 60:
            clock.now += 0.25
            for address, when in due.items():
                if when <= clock.now:
                    heartbeat_worker(service, address)
                    due[address] = when + interval
            service.check_liveness()
            if dead not in service.state.workers:
                noticed = clock.now
        # Live workers reporting at the stretched interval are never taken for dead.
        assert len(service.state.workers) == workers - 1
        assert noticed is not None and noticed <= latest + 0.5, (workers, noticed)
        service.close()


def test_past_capacity_heartbeats_are_refused_first_and_registration_never() -> None:
    meter = cadence.Cadence(budget_rps=500, max_pending=4)
    assert meter.admit("GetSplit") is None and meter.admit("GetSplit") is None
    assert meter.admit("ClientHeartbeat") == pytest.approx(cadence.CLIENT_DEFAULT_S)
    assert meter.admit("WorkerHeartbeat") == pytest.approx(cadence.WORKER_DEFAULT_S)
    assert meter.admit("GetSplit") is None and meter.admit("GetSplit") is None
    assert meter.admit("GetSplit") == pytest.approx(cadence.SPLIT_RETRY_AFTER_S)
    assert meter.admit("GetOrRegisterDataset") is None  # rare and needed: always served
    for _ in range(5):
        meter.done()
    # A request that waited long for a handler thread is refused at once: what is served
    # is served fast. Heartbeats wait half as long.
    assert meter.admit("GetSplit", queued_s=2 * cadence.MAX_QUEUED_S) is not None
    assert meter.admit("WorkerHeartbeat", queued_s=0.6 * cadence.MAX_QUEUED_S) is not None
    assert meter.admit("GetSplit", queued_s=0.6 * cadence.MAX_QUEUED_S) is None
    meter.done()
    meter.update(1, 1, now=1.0)  # refusals stretch the intervals of even a small fleet
    assert meter.load > 1.0 and meter.client_ms > 0
    meter.update(1, 1, now=2.0)
    meter.update(1, 1, now=3.0)
    assert meter.load < 1.5


class Refused(Exception):
    pass


class RecordingContext(Context):
    def set_trailing_metadata(self, metadata) -> None:
        self.metadata = dict(metadata)

    def abort(self, code, details) -> None:
        self.code = code
        raise Refused(f"{code.name}: {details}")


def test_a_refused_request_carries_its_retry_after_in_the_trailing_metadata() -> None:
    service = make_service(Clock(), max_pending_rpcs=1)
    iteration_id, client = start_epoch(service)
    service.cadence.pending = 1  # one request in the handlers already
    context = RecordingContext()
    with pytest.raises(Refused, match="over its capacity"):
        service.ClientHeartbeat(client_request(service, client), context)
    assert context.code.name == "RESOURCE_EXHAUSTED"
    assert int(context.metadata["x-torch-dataservice-retry-after-ms"]) >= 100
    service.close()


def test_a_request_waiting_for_the_journals_fsync_is_not_counted_as_pending(tmp_path) -> None:
    # Journaled, much of a request's time in a handler thread is the group commit's wait:
    # counted, it made a dispatcher refuse heartbeats for its disk's latency, on an idle core.
    service = make_service(Clock(), tmp_path, max_pending_rpcs=2)
    iteration_id, client = start_epoch(service)
    seen = []
    sync = service._journal.sync  # noqa: SLF001 - the journal's own wait, observed

    def observed_sync() -> None:
        seen.append(service.cadence.pending)
        sync()

    service._journal.sync = observed_sync  # noqa: SLF001
    service.ClientHeartbeat(client_request(service, client), RecordingContext())
    assert seen == [0] and service.cadence.pending == 0
    service.close()


class GrpcError(grpc.RpcError):
    """What a stub raises for a status gRPC itself answered (no trailing metadata)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return ()


def test_grpcs_own_refusal_of_a_full_queue_is_overload_that_peers_wait_out() -> None:
    refused = GrpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "Concurrent RPC limit exceeded!")
    assert retry_after_ms(refused) == GRPC_REFUSAL_RETRY_AFTER_MS
    assert is_retryable(refused)
    waits = [rpc.overload_backoff_s(refused, "test") for _ in range(200)]
    low, high = GRPC_REFUSAL_RETRY_AFTER_MS / 2000, GRPC_REFUSAL_RETRY_AFTER_MS * 1.5 / 1000
    assert all(low <= w <= high for w in waits) and len(set(waits)) > 100  # jittered
    # A request over the size limit is refused with the same code and is no overload.
    too_big = GrpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "Received message larger than max (5 vs. 4)")
    assert retry_after_ms(too_big) is None and not is_retryable(too_big)


def test_offsets_travel_as_ranges() -> None:
    assert index_ranges([]) == []
    assert index_ranges([3, 0, 1, 2, 7, 9, 8, 2]) == [0, 4, 7, 10]
    assert index_ranges(range(10_000)) == [0, 10_000]


def test_a_range_acknowledgement_settles_a_split_and_a_bad_range_is_refused() -> None:
    service = make_service(Clock())
    iteration_id, client = start_epoch(service, workers=("a:1",))
    a = task_of(service, iteration_id, "a:1")
    assert get_split(service, iteration_id, a).split_index == 0
    assert get_split(service, iteration_id, a, finished=(0, 0, 5)).split_index == 1
    request = client_request(service, client)
    request.received.add(split=common_pb2.SplitKey(repetition=0, index=0),
                         offset_ranges=[0, 2, 2, 5])
    reply = service.ClientHeartbeat(request, None)
    assert [(s.split.index, s.num_elements) for s in reply.settled] == [(0, 5)]
    assert (0, 0) not in service.state.iteration(iteration_id).delivered
    for ranges in ([0], [3, 3], [0, 1 + (1 << 24)]):
        bad = client_request(service, client)
        bad.received.add(split=common_pb2.SplitKey(repetition=0, index=1), offset_ranges=ranges)
        with pytest.raises(RuntimeError, match="INVALID_ARGUMENT: .*offset"):
            service.ClientHeartbeat(bad, Context())
    service.close()


def test_an_unchanged_task_list_is_not_sent_again() -> None:
    service = make_service(Clock())
    iteration_id, client = start_epoch(service)
    first = service.ClientHeartbeat(client_request(service, client), None)
    assert len(first.tasks) == 2 and not first.tasks_unchanged
    request = client_request(service, client)
    request.known_tasks_version = first.tasks_version
    again = service.ClientHeartbeat(request, None)
    assert again.tasks_unchanged and not again.tasks
    assert again.tasks_version == first.tasks_version
    service.GetOrCreateIteration(pb.GetOrCreateIterationRequest(  # a reader joins: no change
        job_id=service.state.iteration(iteration_id).job_id), None)
    assert service.ClientHeartbeat(request, None).tasks_unchanged
    heartbeat_worker(service, "c:1")  # a worker joins: the list changed
    changed = service.ClientHeartbeat(request, None)
    assert not changed.tasks_unchanged and len(changed.tasks) == 3
    service.close()


def test_a_settled_split_is_told_to_the_clients_that_reported_it_not_to_every_client() -> None:
    service = make_service(Clock())
    iteration_id, client = start_epoch(service, workers=("a:1",))
    job_id = service.state.iteration(iteration_id).job_id
    bystander, late = (service.GetOrCreateIteration(
        pb.GetOrCreateIterationRequest(job_id=job_id), None).client_id for _ in range(2))
    a = task_of(service, iteration_id, "a:1")
    get_split(service, iteration_id, a)
    get_split(service, iteration_id, a, finished=(0, 0, 3))

    def beat(client_id: int, ranges=()) -> pb.ClientHeartbeatResponse:
        request = client_request(service, client_id)
        if ranges:
            request.received.add(split=common_pb2.SplitKey(repetition=0, index=0),
                                 offset_ranges=ranges)
        return service.ClientHeartbeat(request, None)

    assert [s.split.index for s in beat(client, (0, 3)).settled] == [0]
    assert not beat(bystander).settled  # it holds nothing of split 0: nothing to compact
    # Elements of a split settled meanwhile (handed again elsewhere): told at once.
    assert [s.num_elements for s in beat(late, (1, 2)).settled] == [3]
    service.close()


def test_a_peer_whose_heartbeats_are_refused_for_overload_is_not_taken_for_dead() -> None:
    clock = Clock()
    service = make_service(clock, worker_timeout_ms=1000, max_pending_rpcs=1)
    iteration_id, client = start_epoch(service, workers=("refused:1", "silent:1"))
    service.cadence.pending = 1  # busy: every heartbeat is refused from now on
    # Refusing stretches the intervals, and the timeouts with them (at most 20 s).
    for _ in range(60):
        clock.now += 0.5
        with pytest.raises(Refused, match="RESOURCE_EXHAUSTED"):
            service.WorkerHeartbeat(pb.WorkerHeartbeatRequest(
                worker_address="refused:1", worker_uid=1), RecordingContext())
        with pytest.raises(Refused, match="RESOURCE_EXHAUSTED"):
            service.ClientHeartbeat(client_request(service, client), RecordingContext())
        service.check_liveness()
    assert list(service.state.workers) == ["refused:1"]  # the silent one is gone
    assert client not in service._soft.silent_clients  # noqa: SLF001
    service.cadence.pending = 0
    service.close()


def test_a_big_reader_population_beats_less_often_than_workers_within_30_s_detection() -> None:
    """1,000 workers + 4,096 readers: readers stretch past the workers' cap (their beats are
    most of the fleet's), yet a dead worker's splits are handed again within 30 s: noticed
    after 4 worker intervals, then handed once every reader has reported (1 reader interval)."""
    stretch = cadence.population_stretch(1000, 4096, 500)
    worker_s = cadence.interval_ms(cadence.WORKER_DEFAULT_S, stretch,
                                   cadence.MAX_WORKER_INTERVAL_S) / 1000
    client_s = cadence.interval_ms(cadence.CLIENT_DEFAULT_S, stretch,
                                   cadence.MAX_CLIENT_INTERVAL_S) / 1000
    assert client_s > worker_s == 5.0
    assert cadence.LIVENESS_BEATS * worker_s + client_s <= 30.0
    assert 1000 / worker_s + 4096 / client_s < 650  # 1,019/s at a 5-s reader cap
    # Where the budget holds, it is held; the caps only bind past it.
    s = cadence.population_stretch(1000, 2000, 500)
    assert 1000 / min(0.5 * s, 5.0) + 2000 / min(0.1 * s, 10.0) == pytest.approx(500, rel=1e-3)


def test_a_big_fleets_workers_are_told_to_hold_more_splits_so_their_asks_fit_the_budget() -> None:
    assert cadence.split_cover_ms(10, 500, stretch=1.0, load=1.0) == 0  # its own rule
    covers = [cadence.split_cover_ms(n, 500, stretch=2.0, load=1.0) for n in (200, 1000)]
    # A stock refilled at half its target asks twice per cover: the fleet's asks stay at
    # SPLIT_ASK_SHARE of the budget (250 a second), whatever the number of workers.
    for workers, cover_ms in zip((200, 1000), covers, strict=True):
        assert 2 * workers / (cover_ms / 1000) == pytest.approx(250)
    assert cadence.split_cover_ms(10_000, 500, stretch=2.0, load=1.0) == 10_000  # capped
    assert cadence.split_cover_ms(200, 500, stretch=2.0, load=2.0) == 2 * covers[0]  # refusing
    clock = Clock()
    service = make_service(clock)
    iteration_id, _ = start_epoch(service, workers=("w:1",), num_splits=100)
    task_id = task_of(service, iteration_id, "w:1")
    reply = service.GetSplit(pb.GetSplitRequest(iteration_id=iteration_id, task_id=task_id,
                                                replica=0, request_id=1), None)
    assert reply.split_cover_ms == 0  # a small fleet: the worker's own rule
    grow(service, 999, 0)
    service.check_liveness()
    reply = service.GetSplit(pb.GetSplitRequest(iteration_id=iteration_id, task_id=task_id,
                                                replica=0, request_id=2), None)
    assert reply.split_cover_ms == cadence.split_cover_ms(1000, 500, 2.0, 1.0) == 8000
    service.close()


def test_a_worker_whose_tasks_ask_for_splits_is_alive_though_its_heartbeats_are_lost() -> None:
    """An overloaded dispatcher's gRPC queue drops heartbeats unseen (CANCELLED) while it
    serves splits: a worker whose task asks for splits is not taken for dead."""
    clock = Clock()
    service = make_service(clock, worker_timeout_ms=1000)
    iteration_id, _ = start_epoch(service, workers=("asks:1", "silent:1"), num_splits=100)
    task_id = task_of(service, iteration_id, "asks:1")
    for _ in range(10):
        clock.now += 0.5
        get_split(service, iteration_id, task_id)
        service.check_liveness()
    assert list(service.state.workers) == ["asks:1"]  # the silent one is gone
    service.close()


class _DroppingStub:
    """A dispatcher whose gRPC queue drops every heartbeat (CANCELLED, no Python ran)."""

    def ClientHeartbeat(self, request, timeout):  # noqa: N802 - the stub's method name
        raise GrpcError(grpc.StatusCode.CANCELLED, "CANCELLED")


@pytest.mark.parametrize("interval_s", [0.1, 10.0])
def test_a_reader_whose_heartbeat_is_dropped_beats_again_no_sooner_than_it_was_due(
        interval_s: float) -> None:
    # A drop is an overload (wait 250 ms with jitter), but a heartbeat asked to come every
    # 10 s must not come back in a quarter of a second: heartbeats stretch, never shrink.
    membership = Membership.__new__(Membership)  # joined already: only its heartbeat runs
    membership.client_id, membership._tasks_version = 7, 0  # noqa: SLF001
    membership.load = membership._delivery = membership.rounds = None  # noqa: SLF001
    membership.down_since, membership.interval_s = None, interval_s
    membership._stub = _DroppingStub()  # noqa: SLF001
    assert membership._beat() is False  # noqa: SLF001
    low = GRPC_REFUSAL_RETRY_AFTER_MS / 2000
    assert membership.interval_s == interval_s if interval_s >= 1 else membership.interval_s >= low


@pytest.mark.timeout(30)
def test_a_reader_beating_at_its_stretched_interval_is_never_told_it_was_silent() -> None:
    """Past the budget a reader is asked to beat less often than worker_timeout_ms; beating
    when asked, it is not silent (liveness waits LIVENESS_BEATS of its intervals), so no reply
    says it was declared silent. (Replies compared its gap with worker_timeout_ms: at 1,000 +
    4,096, readers asked to beat every 10 s were each told so, and each such beat scanned
    every reader of the iteration.)"""
    clock = Clock()
    service = make_service(clock, worker_timeout_ms=1000, heartbeat_budget_rps=1)
    iteration_id, client = start_epoch(service, workers=("a:1",))
    service.check_liveness()  # sizes the intervals to the budget
    interval = service.ClientHeartbeat(client_request(service, client),
                                       None).next_heartbeat_ms / 1000
    assert interval > 1.0  # longer than the worker timeout
    for _ in range(5):
        clock.now += interval
        heartbeat_worker(service, "a:1")
        service.check_liveness()
        reply = service.ClientHeartbeat(client_request(service, client), None)
        assert not reply.declared_silent
        interval = reply.next_heartbeat_ms / 1000
    assert client in service.state.clients
    service.close()


@pytest.mark.integration
@pytest.mark.timeout(30)
@pytest.mark.parametrize("registered", [True, False], ids=["registered", "generic"])
def test_heartbeats_queued_for_a_handler_wait_behind_other_requests(registered: bool) -> None:
    """A GetSplit that arrives while heartbeats wait for the handler threads is served
    before them (real gRPC server and calls; the method is read from gRPC's call event).
    Registered methods are what the dispatcher's generated service adds: their call event
    names the method elsewhere than a generic handler's."""
    import threading
    import time

    from torch_dataservice.serving import start_grpc_server

    started, release, order = threading.Event(), threading.Event(), []

    def handler(name: str):
        def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
            if name == "Block":
                started.set()
                release.wait(10)
            order.append(name)
            return b""
        return grpc.unary_unary_rpc_method_handler(handle)

    handlers = {name: handler(name) for name in
                ("Block", "ClientHeartbeat", "WorkerHeartbeat", "GetSplit")}

    def add(server: grpc.Server) -> None:
        if registered:
            server.add_registered_method_handlers("test.Queue", handlers)
        else:
            server.add_generic_rpc_handlers(
                (grpc.method_handlers_generic_handler("test.Queue", handlers),))

    executor = cadence.QueuedExecutor(max_workers=1)
    server, port = start_grpc_server(add, "127.0.0.1", 0, executor=executor)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            def call(name: str):
                return channel.unary_unary(f"/test.Queue/{name}").future(b"", timeout=10)

            def queued() -> int:
                with executor._cond:
                    return len(executor._first) + len(executor._heartbeats)

            calls = [call("Block")]
            assert started.wait(10)  # the one handler thread is busy
            for count, name in enumerate(("ClientHeartbeat", "WorkerHeartbeat", "GetSplit")):
                calls.append(call(name))
                deadline = time.monotonic() + 10
                while queued() <= count and time.monotonic() < deadline:
                    time.sleep(0.005)
                assert queued() == count + 1  # queued in this order
            release.set()
            for pending in calls:
                pending.result()
        assert order == ["Block", "GetSplit", "ClientHeartbeat", "WorkerHeartbeat"]
    finally:
        server.stop(None)
        executor.shutdown(wait=False)


@pytest.mark.timeout(20)
def test_only_a_wait_behind_other_requests_is_taken_for_overload() -> None:
    """A heartbeat that found a handler thread idle but ran late (its process not scheduled
    on a busy host) is served: refusing it would stretch a small fleet's failure detection
    for a backlog that is not there. One that waited as long behind other requests is
    refused, and so is one at a dispatcher busy enough that its handler threads wait for
    the GIL (real QueuedExecutor, the service's own admission)."""
    import threading
    import time

    service = make_service(Clock())
    iteration_id, client = start_epoch(service)
    executor = cadence.QueuedExecutor(max_workers=1)
    outcomes: list[str] = []

    def late_heartbeat() -> None:
        cadence._queued.at -= 2 * cadence.MAX_QUEUED_S  # as if it ran that long after arriving
        try:
            service.ClientHeartbeat(client_request(service, client), RecordingContext())
            outcomes.append("served")
        except Refused:
            outcomes.append("refused")

    try:
        deadline = time.monotonic() + 10
        while executor._idle < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        executor.submit(late_heartbeat).result(10)  # a handler was idle for it
        gate = threading.Event()
        blocker = executor.submit(gate.wait, 10)
        while executor._idle and time.monotonic() < deadline:
            time.sleep(0.005)
        queued = executor.submit(late_heartbeat)  # behind the blocked request
        gate.set()
        blocker.result(10)
        queued.result(10)
        service.cadence.cores = cadence.BUSY_CORES  # a busy dispatcher: its wait is its own
        executor.submit(late_heartbeat).result(10)
    finally:
        executor.shutdown(wait=False)
        service.close()
    assert outcomes == ["served", "refused", "refused"]

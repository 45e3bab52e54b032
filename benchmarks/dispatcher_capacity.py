"""The dispatcher's own ceiling: its CPU and GetSplit latency as simulated workers and clients grow.

A real dispatcher runs as a subprocess (`python -m torch_dataservice dispatcher`), once with its
state in memory and once with `--fault-tolerant --work-dir` (every change journaled and
fsynced). Workers and clients are simulated by plain gRPC stubs (`dispatcher_pb2_grpc`,
asyncio) spread over `--procs` processes, doing what the real ones do at the intervals the
dispatcher asks for in its replies (dispatcher/cadence.py; the defaults while it asks none),
and backing off as its RESOURCE_EXHAUSTED refusals ask:
  - a worker heartbeats (default every 500 ms, WorkerConfig.effective_heartbeat_interval_ms),
    listing its tasks, and each of its tasks consumes `--split-rate` DYNAMIC splits/s (a split
    of 10 elements of a 10 ms read on a single-process worker is 10/s; 256-element splits of 8
    processes at 10 ms are ~3/s) from a split stock that is the worker's own (SplitStock,
    worker/task_state.py: it refills at half its target, all that is missing in one GetSplit,
    reporting the splits finished; its target covers twice a GetSplit's latency, so a slow
    dispatcher is asked for more splits per request). `--max-splits-per-ask 1` caps every
    request at one split: the old, pessimistic model of one GetSplit per split;
  - a client joins the job's iteration (GetOrCreateIteration) and heartbeats (default every
    100 ms, client/membership.py HEARTBEAT_INTERVAL_S), acknowledging as offset ranges the
    splits handed out (exactly-once bookkeeping), and naming the task list it holds, as a
    reader of a DYNAMIC job does.
All workers and clients share one DYNAMIC job (one iteration): N trainers reading one fleet.
The population grows step by step (`--workers` and `--clients`, paired lists); each step runs
`--seconds` after a ramp, and per step we read the dispatcher's CPU from /proc/PID/stat over
the window (cores = CPU seconds / wall seconds), the simulators' own CPU apart, the GetSplit
latency of the answered requests (p50/p99, seen by the stubs, beside the simulators' own
event-loop lag), the RPCs answered and refused against those offered (GetSplit: the requests
the stocks made, a retry of one not counted again; heartbeats: every attempt, at the
intervals in force, which move during a window; `attempted_rps` counts every attempt).

One more worker, the probe, runs in a process of its own at a higher priority (nice -10) and
asks one split per GetSplit about 20 times a second: its latency is a GetSplit's end to end,
gRPC's own queue included, without the simulators' event-loop lag (which the stubs' figures
include when the simulators fill their cores). The dispatcher's own timing (its histogram,
from a request's arrival in its handler queue to its reply) is reported beside it.

Baseline, same run: the offered load itself (achieved/offered) and the budget of a core.
"sustains" = the dispatcher used <= 1 core and answered >= 95% of the offered RPCs. The
simulators share the machine with the dispatcher (2 cores here): latency includes their
contention; the dispatcher's CPU is its own. `--dispatcher-core N` pins the dispatcher (every
thread) to core N and everything else to the other cores, as a dispatcher host of one core
would run: it cannot take more than that core, and the simulators cannot take it from it.

    python benchmarks/dispatcher_capacity.py --quick    # about a minute
    python benchmarks/dispatcher_capacity.py --workers 1000 --clients 4096 --modes journal
    python benchmarks/dispatcher_capacity.py --json benchmarks/results/dispatcher_capacity.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing
import os
import random
import re
import shutil
import socket
import sys
import tempfile
import time
import urllib.request
from collections import deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from _common import spawn_server, stop_servers

from torch_dataservice.config import WorkerConfig
from torch_dataservice.worker.task_state import stock_depth

if TYPE_CHECKING:
    from torch_dataservice.worker.task_state import FetchSplits

WORKER_HEARTBEAT_S = 0.5  # WorkerConfig.effective_heartbeat_interval_ms default
CLIENT_HEARTBEAT_S = 0.1  # client/membership.py HEARTBEAT_INTERVAL_S
FEED_REPLICA = 1 << 20  # worker/task_state.py: the replica id a task's split stock uses
SPLIT_SIZE = 10
RETRY_BACKOFF_S = (0.05, 1.0)  # rpc.retry's first and longest backoff: a worker's GetSplit
# The shared job's dataset: far more splits than any window hands out, so no epoch ends and
# every task's stock has its full depth (WorkerConfig.split_prefetch, 64).
DATASET_ELEMENTS = 10**12
NUM_SPLITS = DATASET_ELEMENTS // SPLIT_SIZE
STOCK_DEPTH = stock_depth(WorkerConfig.split_prefetch, NUM_SPLITS)
PEERS_PER_CHANNEL = 10  # simulated peers sharing one HTTP/2 connection
BUDGET_CORES = 1.0
# The probe: one more worker, in its own process at a higher priority than the simulators,
# asking one split per GetSplit at this rate (~20 GetSplit/s, ~3% of a big fleet's requests).
PROBE_SPLIT_RATE = 20.0
PROBE_NICE = -10
GROW_TIMEOUT_S = 300  # default --grow-timeout: thousands of peers join while some are refused


# ============================================================================ simulators


class Sim:
    """One simulator process: some workers and clients, on asyncio stubs."""

    def __init__(self, address: str, index: int, split_rate: float, max_per_ask: int) -> None:
        self.address, self.index, self.split_rate = address, index, split_rate
        self.max_per_ask, self.stock_depth = max_per_ask, STOCK_DEPTH
        self.asked: deque[tuple[float, int]] = deque()  # (time, splits one GetSplit got)
        self.fetches: deque[float] = deque()  # when each GetSplit was first sent
        self.events: deque[tuple[float, str, float]] = deque()  # (end time, kind, latency)
        self.errors: deque[tuple[float, str]] = deque()
        self.refusals: deque[tuple[float, str]] = deque()  # RESOURCE_EXHAUSTED + retry-after
        self.lags: deque[tuple[float, float]] = deque()  # (time, event loop lag)
        self.received: deque[tuple[int, int]] = deque()  # (task id, split index) to report
        self.channels: list = []
        self.coroutines: list[asyncio.Task] = []
        self.workers = self.clients = 0
        self.job_id = 0
        self.grow_timeout_s = GROW_TIMEOUT_S
        # The intervals the dispatcher asked for last (0: the defaults).
        self.worker_interval_s, self.client_interval_s = WORKER_HEARTBEAT_S, CLIENT_HEARTBEAT_S

    def stub(self):
        import grpc

        from torch_dataservice.proto import dispatcher_pb2_grpc

        peers = self.workers + self.clients
        if len(self.channels) <= peers // PEERS_PER_CHANNEL:
            self.channels.append(grpc.aio.insecure_channel(self.address))
        return dispatcher_pb2_grpc.DispatcherServiceStub(self.channels[-1])

    async def call(self, kind: str, method, request):
        """The response, or None after an error; a refusal first waits its retry-after
        (with jitter), as rpc.overload_backoff_s does."""
        import grpc

        from torch_dataservice.errors import retry_after_ms

        start = time.perf_counter()
        try:
            response = await method(request, timeout=10)
        except grpc.aio.AioRpcError as error:
            hint = retry_after_ms(error)  # the dispatcher's, or gRPC's own full queue
            if hint is not None:
                self.refusals.append((time.time(), kind))
                await asyncio.sleep(hint / 1000 * (0.5 + random.random()))
            else:
                self.errors.append((time.time(), f"{kind}: {error.code().name}"))
            return None
        except Exception as error:  # noqa: BLE001 - counted
            self.errors.append((time.time(), f"{kind}: {type(error).__name__}"))
            return None
        self.events.append((time.time(), kind, time.perf_counter() - start))
        return response

    async def worker(self, i: int, registered: asyncio.Future) -> None:
        from torch_dataservice.proto import dispatcher_pb2

        stub = self.stub()
        # A loopback address where nothing listens: the dispatcher's task pushes fail fast.
        address = f"127.{100 + self.index}.{i // 250}.{i % 250 + 1}:9"
        uid = random.getrandbits(62)
        tasks: dict[int, asyncio.Task] = {}
        await asyncio.sleep(random.random() * WORKER_HEARTBEAT_S)
        interval = WORKER_HEARTBEAT_S  # kept after an error, as a worker does
        while True:
            began = time.monotonic()
            response = await self.call("worker_heartbeat", stub.WorkerHeartbeat,
                                       dispatcher_pb2.WorkerHeartbeatRequest(
                                           worker_address=address, worker_uid=uid,
                                           current_tasks=list(tasks), host_id="sim",
                                           process_id=f"sim-{self.index}-{i}"))
            if response is not None:
                interval = response.next_heartbeat_ms / 1000 or WORKER_HEARTBEAT_S
                self.worker_interval_s = interval
                for task in response.new_tasks:
                    if task.task_id not in tasks:
                        tasks[task.task_id] = asyncio.ensure_future(self.split_loop(stub, task))
                for task_id in response.tasks_to_delete:
                    loop = tasks.pop(task_id, None)
                    if loop is not None:
                        loop.cancel()
                if not registered.done():
                    registered.set_result(None)
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - began)))

    async def split_loop(self, stub, task) -> None:
        """One task: a reader of its splits takes one every 1/split_rate s from a split stock
        run by the worker's own SplitStock (worker/task_state.py), which asks the dispatcher
        for what it misses, reporting the splits finished, one GetSplit in flight at a time.
        `max_per_ask` caps a request (1: the old model, one GetSplit per split)."""
        from torch_dataservice.wire.splits import HandedSplit, SplitKey
        from torch_dataservice.worker.messages import FinishedSplit
        from torch_dataservice.worker.task_state import SplitStock, _Waiter

        stock = SplitStock(self.stock_depth)
        arrived = asyncio.Event()
        taken: deque[HandedSplit] = deque()
        interval = 1 / self.split_rate

        async def fetch(request: FetchSplits) -> None:
            response, backoff = None, RETRY_BACKOFF_S[0]
            self.fetches.append(time.time())
            while response is None:  # a refused or failed request goes again, the same
                refusals = len(self.refusals)
                response = await self.call("get_split", stub.GetSplit, self._split_request(
                    task, request, min(request.max_splits, self.max_per_ask)))
                if response is None and len(self.refusals) == refusals:  # not refused:
                    # rpc.retry's jittered exponential backoff (a refusal waited its hint)
                    await asyncio.sleep(backoff * (0.5 + random.random()))
                    backoff = min(2 * backoff, RETRY_BACKOFF_S[1])
            got = [] if response.end_of_splits else [response, *response.following]
            self.asked.append((time.time(), len(got)))
            stock.budget.told_cover_s = response.split_cover_ms / 1000  # as TaskState does
            stock.fetched(request.repetition, [HandedSplit(SplitKey(s.repetition, s.split_index))
                                              for s in got], None, now=time.monotonic())
            pump()

        def pump() -> None:
            answered, _, request = stock.answer_waiters(time.monotonic())
            for _, splits in answered:
                taken.extend(split for _, split in splits)
            if answered:
                arrived.set()
            if request is not None:
                self.coroutines.append(asyncio.ensure_future(fetch(request)))

        finished = None
        due = time.monotonic() + random.random() * interval
        for number in itertools.count():
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            due = max(due + interval, time.monotonic())  # behind: no burst to catch up
            arrived.clear()
            stock.ask(_Waiter(0, number, 0, 1), finished, time.monotonic())
            pump()
            while not taken:
                await arrived.wait()
                arrived.clear()
            split = taken.popleft()
            self.received.append((task.task_id, split.key.index))
            finished = FinishedSplit(split.key.repetition, split.key.index, SPLIT_SIZE)

    @staticmethod
    def _split_request(task, request: FetchSplits, max_splits: int):
        from torch_dataservice.proto import common_pb2, dispatcher_pb2

        message = dispatcher_pb2.GetSplitRequest(
            iteration_id=task.iteration_id, repetition=request.repetition,
            task_id=task.task_id, replica=FEED_REPLICA, request_id=request.request_id + 1,
            max_splits=max_splits)
        for done in request.finished:
            message.finished_splits.add(
                split=common_pb2.SplitKey(repetition=done.repetition, index=done.index),
                elements=done.elements)
        return message

    async def client(self, joined: asyncio.Future) -> None:
        from torch_dataservice.proto import common_pb2, dispatcher_pb2

        stub = self.stub()
        while True:
            response = await self.call("join", stub.GetOrCreateIteration,
                                       dispatcher_pb2.GetOrCreateIterationRequest(
                                           job_id=self.job_id, repetition=0))
            if response is not None:
                break
            await asyncio.sleep(0.5)
        client_id = response.client_id
        joined.set_result(None)
        # The join reply's interval (a big fleet's readers start stretched), as a reader's.
        interval = response.next_heartbeat_ms / 1000 or CLIENT_HEARTBEAT_S
        await asyncio.sleep(random.random() * interval)
        tasks_version = 0
        while True:
            began = time.monotonic()
            request = dispatcher_pb2.ClientHeartbeatRequest(
                client_id=client_id, known_tasks_version=tasks_version)
            # This client received some of the splits this process's workers handed out, and
            # acknowledges each whole as one range.
            for _ in range(min(len(self.received), 1 + len(self.received) // max(1, self.clients))):
                task_id, index = self.received.popleft()
                request.received.add(task_id=task_id,
                                     split=common_pb2.SplitKey(repetition=0, index=index),
                                     offset_ranges=(0, SPLIT_SIZE))
            reply = await self.call("client_heartbeat", stub.ClientHeartbeat, request)
            if reply is not None:
                tasks_version = reply.tasks_version
                interval = reply.next_heartbeat_ms / 1000 or CLIENT_HEARTBEAT_S
                self.client_interval_s = interval
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - began)))

    async def probe(self) -> None:
        """How late this simulator's event loop runs: latency it adds to every call."""
        while True:
            began = time.monotonic()
            await asyncio.sleep(0.05)
            self.lags.append((time.time(), time.monotonic() - began - 0.05))

    async def grow(self, workers: int, clients: int) -> None:
        loop = asyncio.get_running_loop()
        if not self.coroutines:
            self.coroutines.append(asyncio.ensure_future(self.probe()))
        waits = []
        while self.workers < workers:
            future = loop.create_future()
            self.coroutines.append(asyncio.ensure_future(self.worker(self.workers, future)))
            self.workers += 1
            waits.append(future)
        while self.clients < clients:
            future = loop.create_future()
            self.coroutines.append(asyncio.ensure_future(self.client(future)))
            self.clients += 1
            waits.append(future)
        await asyncio.wait_for(asyncio.gather(*waits), self.grow_timeout_s)

    def stats(self, t0: float, t1: float) -> dict:
        counts: dict[str, int] = {}
        latencies = []
        while self.events and self.events[0][0] < t0:
            self.events.popleft()
        for end, kind, latency in self.events:
            if end <= t1:
                counts[kind] = counts.get(kind, 0) + 1
                if kind == "get_split":
                    latencies.append(latency)
        errors = [kind for end, kind in self.errors if t0 <= end <= t1]
        return {"counts": counts, "split_latencies": latencies, "errors": errors,
                "splits": [n for t, n in self.asked if t0 <= t <= t1],
                "fetches": sum(t0 <= t <= t1 for t in self.fetches),
                "refused": [kind for t, kind in self.refusals if t0 <= t <= t1],
                "lags": [lag for t, lag in self.lags if t0 <= t <= t1],
                "cpu_s": time.process_time(),
                "intervals": (self.worker_interval_s, self.client_interval_s)}


def _sim_main(address: str, index: int, split_rate: float, max_per_ask: int, conn,
              nice: int = 0) -> None:
    if nice:
        try:
            os.nice(nice)
        except PermissionError:  # not root: the probe's latency then includes the simulators'
            print("(the probe could not raise its priority: its latency includes the "
                  "simulators' CPU contention)", file=sys.stderr)
    asyncio.run(_sim_loop(Sim(address, index, split_rate, max_per_ask), conn))


async def _sim_loop(sim: Sim, conn) -> None:
    loop = asyncio.get_running_loop()
    conn.send("ready")
    while True:
        command = await loop.run_in_executor(None, conn.recv)
        if command[0] == "stop":
            for coroutine in sim.coroutines:
                coroutine.cancel()
            for channel in sim.channels:
                await channel.close()
            conn.send("stopped")
            return
        if command[0] == "grow":
            _, workers, clients, sim.job_id, sim.grow_timeout_s = command
            try:
                await sim.grow(workers, clients)
                conn.send(("grown", None))
            except Exception as error:  # noqa: BLE001 - reported to the parent
                conn.send(("grown", f"{type(error).__name__}: {error}"))
        elif command[0] == "stats":
            conn.send(sim.stats(command[1], command[2]))


class Sims:
    def __init__(self, address: str, n: int, split_rate: float, max_per_ask: int,
                 first_index: int = 0, nice: int = 0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for i in range(first_index, first_index + n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_sim_main,
                               args=(address, i, split_rate, max_per_ask, child, nice),
                               daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for conn in self.conns:
            if not conn.poll(120) or conn.recv() != "ready":
                raise RuntimeError("a simulator process did not start")

    def grow(self, workers: int, clients: int, job_id: int, timeout_s: float) -> None:
        n = len(self.conns)
        for i, conn in enumerate(self.conns):  # spread as evenly as possible
            conn.send(("grow", workers // n + (i < workers % n),
                       clients // n + (i < clients % n), job_id, timeout_s))
        for conn in self.conns:
            if not conn.poll(timeout_s + 30):
                raise RuntimeError(f"simulators did not grow in {timeout_s + 30:.0f} s")
            _, error = conn.recv()
            if error:
                raise RuntimeError(f"a simulator failed to grow: {error}")

    def stats(self, t0: float, t1: float) -> list[dict]:
        for conn in self.conns:
            conn.send(("stats", t0, t1))
        return [conn.recv() for conn in self.conns]

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("stop",))
        for conn, proc in zip(self.conns, self.procs, strict=True):
            with contextlib.suppress(OSError, EOFError):
                if conn.poll(10):
                    conn.recv()
            proc.join(5)
            if proc.is_alive():
                proc.kill()


# ============================================================================ the dispatcher


class Dispatcher:
    def __init__(self, work_dir: str | None, extra: list[str], core: int | None) -> None:
        self.metrics_port = free_port()
        args = ["dispatcher", "--port", "0", "--host", "127.0.0.1",
                "--metrics-port", str(self.metrics_port), *extra]
        if work_dir:
            args += ["--fault-tolerant", "--work-dir", work_dir]
        pin = None if core is None else (lambda: os.sched_setaffinity(0, {core}))
        self.proc, self.address = spawn_server(args, log_level="ERROR", start_new_session=True,
                                               preexec_fn=pin)

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime+stime

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def split_histogram(self) -> dict[float, float]:
        """GetSplit's cumulative counts per bucket bound (seconds) of the dispatcher's own
        tds_dispatcher_rpc_seconds: from the request's arrival in its handler threads' queue
        to its reply, so none of the simulators' lag is in it."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        found = {}
        for match in re.finditer(r'^tds_dispatcher_rpc_seconds_bucket\{(.*?)\} (\S+)$', text,
                                 re.MULTILINE):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
            if labels.get("method") == "GetSplit":
                found[float(labels["le"])] = float(match.group(2))
        return found

    def close(self) -> None:
        stop_servers([self.proc], timeout_s=20)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def histogram_quantile(before: dict[float, float], after: dict[float, float],
                       q: float) -> tuple[float, float]:
    """(the q-quantile in seconds, interpolated in its bucket as Prometheus does; the share
    answered within 50 ms) of what was observed between two scrapes."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return float("nan"), float("nan")
    within_50ms = counts[bounds.index(0.05)] / total if 0.05 in bounds else float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if bound == float("inf"):
                return lower, within_50ms
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-9), \
                within_50ms
        lower, below = bound, count
    return lower, within_50ms


def create_job(address: str, tag: str) -> int:
    """Register an effectively endless DYNAMIC dataset and create one shared job on it."""
    import torch_dataservice as tds
    from torch_dataservice.policies import ShardingPolicy
    from torch_dataservice.proto import common_pb2, dispatcher_pb2, dispatcher_pb2_grpc
    from torch_dataservice.rpc import channel_to

    pipeline = tds.Pipeline.range(DATASET_ELEMENTS).with_split_size(SPLIT_SIZE)
    dataset_id = tds.register_dataset(f"grpc://{address}", pipeline, compression=None)
    stub = dispatcher_pb2_grpc.DispatcherServiceStub(channel_to(address))
    return stub.GetOrCreateJob(dispatcher_pb2.GetOrCreateJobRequest(config=common_pb2.JobConfig(
        dataset_id=dataset_id, job_name=f"capacity-{tag}",
        sharding_policy=int(ShardingPolicy.DYNAMIC), target_workers="ANY")),
        timeout=30).job_id


# ============================================================================ measuring


@dataclass
class Row:
    mode: str  # "memory" or "journal"
    workers: int
    clients: int
    seconds: float
    cores: float  # dispatcher CPU seconds per wall second
    sim_cores: float  # the simulators' own, apart
    rss_mb: float
    offered_rps: float  # at the intervals in force
    attempted_rps: float  # retries too
    achieved_rps: float  # answered
    refused_rps: float  # RESOURCE_EXHAUSTED with a retry-after
    split_rps: float  # GetSplit requests answered
    splits_per_ask: float  # splits one answered GetSplit handed out, on average
    split_p50_ms: float  # answered GetSplit requests
    split_p99_ms: float
    errors: int
    worker_interval_ms: float  # in force (asked by the dispatcher, or the default)
    client_interval_ms: float
    sim_lag_p99_ms: float  # simulators' event-loop lag: latency not the dispatcher's
    # GetSplit as the dispatcher timed it (its queue, handling and journal; accepted ones)
    server_split_p99_ms: float = float("nan")  # interpolated in its histogram bucket
    server_split_within_50ms: float = float("nan")  # share answered within 50 ms
    # GetSplit as one more worker saw it, end to end, from a process of its own that the
    # scheduler favours over the simulators (PROBE_NICE): gRPC's own queue included, the
    # simulators' event-loop lag not
    probe_split_p50_ms: float = float("nan")
    probe_split_p99_ms: float = float("nan")
    probe_splits: int = 0  # its answered GetSplit requests in the window
    probe_lag_p99_ms: float = float("nan")  # its own event loop's lag

    @property
    def sustained(self) -> bool:
        return self.cores <= BUDGET_CORES and self.achieved_rps >= 0.95 * self.offered_rps


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_mode(mode: str, sizes: list[tuple[int, int]], seconds: float, ramp: float,
             procs: int, split_rate: float, max_per_ask: int, stop_cores: float,
             grow_timeout_s: float, log, dispatcher_args: list[str],
             dispatcher_core: int | None) -> list[Row]:
    rows: list[Row] = []
    work_dir = tempfile.mkdtemp(prefix="tds-capacity-") if mode == "journal" else None
    dispatcher = Dispatcher(work_dir, dispatcher_args, dispatcher_core)
    sims = probe = None
    try:
        job_id = create_job(dispatcher.address, mode)
        sims = Sims(dispatcher.address, procs, split_rate, max_per_ask)
        probe = Sims(dispatcher.address, 1, PROBE_SPLIT_RATE, 1, first_index=procs,
                     nice=PROBE_NICE)
        probe.grow(1, 0, job_id, grow_timeout_s)
        for workers, clients in sizes:
            grow_began = time.perf_counter()
            try:
                sims.grow(workers, clients, job_id, grow_timeout_s)
            except RuntimeError as error:  # the rows measured so far still count
                log(f"  {mode}: {workers} workers + {clients} clients did not join: {error}; "
                    "larger steps skipped")
                break
            log(f"  {mode}: {workers} workers + {clients} clients joined in "
                f"{time.perf_counter() - grow_began:.1f} s")
            time.sleep(ramp)  # every worker has its task and is asking for splits
            t0, cpu0 = time.time(), dispatcher.cpu_seconds()
            histogram0 = dispatcher.split_histogram()
            sim_cpu0 = sum(s["cpu_s"] for s in sims.stats(t0, t0))
            time.sleep(seconds)
            t1, cpu1 = time.time(), dispatcher.cpu_seconds()
            server_p99, within_50ms = histogram_quantile(
                histogram0, dispatcher.split_histogram(), 0.99)
            stats = sims.stats(t0, t1)
            [probed] = probe.stats(t0, t1)
            wall = t1 - t0
            counts: dict[str, int] = {}
            latencies: list[float] = []
            refused: list[str] = []
            error_kinds: dict[str, int] = {}
            granted: list[int] = []
            for s in stats:
                for kind, count in s["counts"].items():
                    counts[kind] = counts.get(kind, 0) + count
                latencies += s["split_latencies"]
                granted += s["splits"]
                for kind in s["errors"]:
                    error_kinds[kind] = error_kinds.get(kind, 0) + 1
                refused += s["refused"]
            errors = sum(error_kinds.values())
            lags = [lag for s in stats for lag in s["lags"]]
            if errors:
                log(f"  {mode}: errors {sorted(error_kinds.items(), key=lambda e: -e[1])[:3]}")
            worker_s = max(s["intervals"][0] for s in stats)
            client_s = max(s["intervals"][1] for s in stats)
            # Offered: the GetSplit requests the stocks made, and every heartbeat attempt at
            # the intervals in force (which move during a window). Attempted: every attempt,
            # answered, refused or failed, retries too.
            kinds = ("worker_heartbeat", "get_split", "client_heartbeat")
            attempts = {k: counts.get(k, 0) + sum(r == k for r in refused) + sum(
                n for e, n in error_kinds.items() if e.split(":")[0] == k) for k in kinds}
            offered = (attempts["worker_heartbeat"] + attempts["client_heartbeat"]
                       + sum(s["fetches"] for s in stats)) / wall
            achieved = sum(counts.get(k, 0) for k in kinds) / wall
            row = Row(mode, workers, clients, wall, (cpu1 - cpu0) / wall,
                      (sum(s["cpu_s"] for s in stats) - sim_cpu0) / wall,
                      dispatcher.rss_mb(), offered, sum(attempts.values()) / wall, achieved,
                      len(refused) / wall,
                      counts.get("get_split", 0) / wall,
                      sum(granted) / len(granted) if granted else float("nan"),
                      1000 * percentile(latencies, 0.5), 1000 * percentile(latencies, 0.99),
                      errors, 1000 * worker_s, 1000 * client_s, 1000 * percentile(lags, 0.99),
                      1000 * server_p99, within_50ms,
                      1000 * percentile(probed["split_latencies"], 0.5),
                      1000 * percentile(probed["split_latencies"], 0.99),
                      len(probed["split_latencies"]), 1000 * percentile(probed["lags"], 0.99))
            rows.append(row)
            log(f"  {mode}: {workers} workers + {clients} clients: dispatcher "
                f"{row.cores:.2f} cores (simulators {row.sim_cores:.2f}), "
                f"GetSplit p50 {row.split_p50_ms:.1f} ms p99 {row.split_p99_ms:.1f} ms "
                f"({row.splits_per_ask:.1f} splits each; as the dispatcher timed it p99 "
                f"{row.server_split_p99_ms:.0f} ms, {100 * row.server_split_within_50ms:.1f}% "
                f"within 50 ms; the probe's p50 {row.probe_split_p50_ms:.1f} ms p99 "
                f"{row.probe_split_p99_ms:.1f} ms over {row.probe_splits} GetSplits, its loop "
                f"lag p99 {row.probe_lag_p99_ms:.0f} ms), "
                f"RPCs {achieved:,.0f}/{offered:,.0f} per s ({row.attempted_rps:,.0f} "
                f"attempts), refused {row.refused_rps:,.0f}/s, "
                f"intervals {row.worker_interval_ms:.0f}/{row.client_interval_ms:.0f} ms, "
                f"simulator loop lag p99 {row.sim_lag_p99_ms:.0f} ms")
            if row.cores > stop_cores:
                log(f"  {mode}: above {stop_cores} cores: larger steps skipped")
                break
    finally:
        for simulators in (sims, probe):
            if simulators is not None:
                simulators.close()
        dispatcher.close()
        if work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)
    return rows


def print_table(rows: list[Row]) -> None:
    header = (f"{'mode':<8} {'workers':>7} {'clients':>7} {'disp cores':>10} {'sim cores':>9} "
              f"{'RSS MB':>7} {'RPC/s done/offered':>19} {'refused/s':>9} {'GetSplit/s':>10} "
              f"{'p50 ms':>7} {'p99 ms':>7} {'srv p99':>7} {'<=50ms':>6} {'probe p99':>9} "
              f"{'splits/ask':>10} "
              f"{'hb ms w/c':>11} {'errors':>6}  <=1 core")
    print(header)
    print("-" * len(header))
    for r in rows:
        done = f"{r.achieved_rps:,.0f}/{r.offered_rps:,.0f}"
        intervals = f"{r.worker_interval_ms:.0f}/{r.client_interval_ms:.0f}"
        print(f"{r.mode:<8} {r.workers:>7} {r.clients:>7} {r.cores:>10.2f} {r.sim_cores:>9.2f} "
              f"{r.rss_mb:>7.0f} {done:>19} {r.refused_rps:>9,.0f} {r.split_rps:>10,.0f} "
              f"{r.split_p50_ms:>7.1f} {r.split_p99_ms:>7.1f} {r.server_split_p99_ms:>7.1f} "
              f"{100 * r.server_split_within_50ms:>5.1f}% {r.probe_split_p99_ms:>9.1f} "
              f"{r.splits_per_ask:>10.1f} "
              f"{intervals:>11} {r.errors:>6}  "
              f"{'yes' if r.sustained else 'NO'}")


def _counts(text: str, flag: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated counts, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise ValueError(f"{flag} counts must be >= 1, got {text!r}")
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short steps (about a minute)")
    parser.add_argument("--workers", default=None,
                        help="simulated workers per step, comma-separated (quick 10,50,100,200; "
                             "full 10,25,50,100,200,400)")
    parser.add_argument("--clients", default=None,
                        help="simulated clients per step, paired with --workers (default: the "
                             "same counts)")
    parser.add_argument("--modes", default="memory,journal",
                        help="memory (no journal), journal (--fault-tolerant --work-dir)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="measured window per step (quick 3, full 8)")
    parser.add_argument("--ramp", type=float, default=1.5, help="seconds before each window")
    parser.add_argument("--procs", type=int, default=3, help="simulator processes")
    parser.add_argument("--split-rate", type=float, default=2.0,
                        help="splits a worker's task consumes per second (default: 2)")
    parser.add_argument("--max-splits-per-ask", type=int, default=STOCK_DEPTH,
                        help=f"cap on one GetSplit's max_splits (default {STOCK_DEPTH}: as the "
                             "worker's stock asks; 1: one GetSplit per split, the old model)")
    parser.add_argument("--stop-cores", type=float, default=1.5,
                        help="skip larger steps once the dispatcher used this many cores")
    parser.add_argument("--grow-timeout", type=float, default=GROW_TIMEOUT_S,
                        help="seconds a step's peers may take to join (then it and larger "
                             "steps are skipped)")
    parser.add_argument("--dispatcher-args", default="",
                        help="more `torch-dataservice dispatcher` options, e.g. "
                             "'--max-pending-rpcs 64 --heartbeat-budget-rps 800'")
    parser.add_argument("--dispatcher-core", type=int, default=-1,
                        help="pin the dispatcher to this core and the simulators to the "
                             "others (-1: no pinning, the default)")
    parser.add_argument("--json", default=None, help="write the rows to this JSON file")
    args = parser.parse_args(argv)
    try:
        workers = _counts(args.workers or ("10,50,100,200" if args.quick
                                           else "10,25,50,100,200,400"), "--workers")
        clients = _counts(args.clients, "--clients") if args.clients else workers
    except ValueError as error:
        parser.error(str(error))
    if len(clients) != len(workers):
        parser.error(f"--clients has {len(clients)} counts and --workers {len(workers)}: "
                     "they pair up, one step each")
    sizes = list(zip(workers, clients, strict=True))
    core = None if args.dispatcher_core < 0 else args.dispatcher_core
    if core is not None:
        others = os.sched_getaffinity(0) - {core}
        if core not in os.sched_getaffinity(0) or not others:
            parser.error(f"--dispatcher-core {core}: this process may use cores "
                         f"{sorted(os.sched_getaffinity(0))}, and needs another beside it")
        os.sched_setaffinity(0, others)  # this process and the simulators it starts
    seconds = args.seconds or (3.0 if args.quick else 8.0)
    began = time.perf_counter()
    rows: list[Row] = []
    modes = args.modes.split(",")
    for mode in modes:
        if mode not in ("memory", "journal"):
            parser.error(f"unknown mode {mode!r}")
        rows += run_mode(mode, sizes, seconds, args.ramp, args.procs, args.split_rate,
                         args.max_splits_per_ask,
                         args.stop_cores, args.grow_timeout, lambda m: print(m, flush=True),
                         args.dispatcher_args.split(), core)

    print()
    pinned = ("unpinned" if core is None
              else f"pinned to core {core}, the simulators to the others")
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, dispatcher {pinned}, "
          f"{seconds:g} s per step, {args.procs} simulator processes, default heartbeats "
          f"{WORKER_HEARTBEAT_S * 1000:.0f}/{CLIENT_HEARTBEAT_S * 1000:.0f} ms (worker/client) "
          f"until the dispatcher asks otherwise, {args.split_rate:g} splits/s per worker from "
          f"a stock of depth {STOCK_DEPTH} asking <= {args.max_splits_per_ask} per GetSplit, "
          f"dataset {DATASET_ELEMENTS:.0e} elements in splits of {SPLIT_SIZE}, "
          f"{time.perf_counter() - began:.0f} s; baseline: the offered RPC rate and a budget of "
          f"{BUDGET_CORES} core")
    print_table(rows)
    for mode in dict.fromkeys(r.mode for r in rows):
        ok = [r for r in rows if r.mode == mode and r.sustained]
        best = max(ok, key=lambda r: r.workers + r.clients, default=None)
        print(f"{mode}: within {BUDGET_CORES} core, the largest step sustained: "
              + (f"{best.workers} workers + {best.clients} clients" if best else "none"))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "dispatcher_capacity", "cores": os.cpu_count(),
                       "load_average": os.getloadavg()[0],
                       "split_rate": args.split_rate,
                       "max_splits_per_ask": args.max_splits_per_ask, "stock_depth": STOCK_DEPTH,
                       "dataset_elements": DATASET_ELEMENTS, "split_size": SPLIT_SIZE,
                       "budget_cores": BUDGET_CORES,
                       "rows": [{**asdict(r), "sustained": r.sustained} for r in rows]},
                      f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())

"""Throughput of the data path, each figure beside a baseline measured in the same run.

One worker and one consumer on loopback. The dispatcher and the worker run as subprocesses
(`python -m torch_dataservice ...`), so elements really travel executor -> worker front -> the
worker's data port -> this process: through its Unix socket by default (same host), over TCP
with `--target-workers ANY`, as a remote trainer would (an in-process reader would skip both).
Machines are shared and noisy, so every figure is a ratio against a baseline measured in the
same run:

  (a) tiny elements/s (`Pipeline.range(N)`)       vs  bare gRPC unary round trips/s
  (b) MB/s of 1 MB and 16 MB uint8 tensors,
      compression None and "AUTO"                 vs  raw TCP loopback between two processes
  (c) a CPU-bound pure-Python map (~5 ms/element) with num_processes=1 and =2
                                                  vs  the same map run locally
  (d) a tensor-op map (~2 ms of torch matmuls, one torch thread) on 2 executor processes,
      returning a 16 KB tensor, and the same returning a float
                                                  vs  torch's DataLoader(num_workers=2) over
                                                      the same map, element by element
  (e) `batch(256)` of tiny elements, read as distributed_epoch (DYNAMIC: one split of 256
      elements per batch, exactly-once bookkeeping)
                                                  vs  the same read as parallel_epochs

Two more reference rows say what the machine itself allowed during the run: bare gRPC moving
16 MB replies (the ceiling of any gRPC data path), and the map in 2 plain processes vs 1 (what
the cores give when other programs share them). Each figure and its baseline are measured in
`--rounds` interleaved rounds and the best of each is kept: the least disturbed measurement.
Executor start-up and job start are not counted: readings start after a few warm-up elements.
If `tensorflow` is importable the same workloads also run through tf.data service (never a
dependency). MB = 10**6 bytes.

    python benchmarks/throughput.py --quick     # < 60 s
    python benchmarks/throughput.py             # a few minutes
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from _common import free_port, spawn_server, stop_servers

MB = 10**6
MAP_MS = 5.0  # target cost of one element of the CPU-bound map
TENSOR_MAP_MS = 2.0  # target cost of one element of the tensor-op map
TARGET_WORKERS = "AUTO"  # --target-workers
METRICS = False  # --metrics: servers expose /metrics and a thread scrapes them every 0.5 s


@dataclass
class Settings:
    rounds: int  # each figure and its baseline are measured this many times, interleaved
    seconds: float  # how long one gRPC round-trip measurement runs
    tiny_elements: int
    big_bytes_total: int  # bytes read per (size, compression) case and round
    tcp_bytes_total: int
    map_elements: int  # per worker process
    warmup: int
    tensor_elements: int  # per round of (d), for each loader


QUICK = Settings(rounds=2, seconds=1.0, tiny_elements=30_000, big_bytes_total=300 * MB,
                 tcp_bytes_total=600 * MB, map_elements=80, warmup=10, tensor_elements=800)
FULL = Settings(rounds=4, seconds=3.0, tiny_elements=200_000, big_bytes_total=1_600 * MB,
                tcp_bytes_total=3_200 * MB, map_elements=400, warmup=20,
                tensor_elements=3000)


@dataclass
class Row:
    figure: str
    value: float
    unit: str
    baseline: str
    baseline_value: float
    baseline_unit: str
    ratio: float
    ratio_unit: str  # "x" or "%"
    target: float | None  # minimum ratio, or None when informational

    def ok(self) -> str:
        if self.target is None:
            return "-"
        return "yes" if self.ratio >= self.target else "NO"


# ============================================================================ baselines


def _echo_server(port_queue: multiprocessing.Queue, stop: multiprocessing.Event) -> None:
    import grpc

    big = os.urandom(16 * MB)
    server = grpc.server(ThreadPoolExecutor(max_workers=4),
                         options=[("grpc.max_send_message_length", -1)])
    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(
            lambda request, context: request, request_deserializer=None,
            response_serializer=None),
        "Big": grpc.unary_unary_rpc_method_handler(
            lambda request, context: big, request_deserializer=None, response_serializer=None),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", handlers),))
    port = server.add_insecure_port("localhost:0")
    server.start()
    port_queue.put(port)
    stop.wait()
    server.stop(0)


class GrpcBaseline:
    """A trivial gRPC server in another process: raw-bytes echo, and a fixed 16 MB reply."""

    def __init__(self) -> None:
        import grpc

        ctx = multiprocessing.get_context("spawn")
        ports, self._stop = ctx.Queue(), ctx.Event()
        self._server = ctx.Process(target=_echo_server, args=(ports, self._stop), daemon=True)
        self._server.start()
        port = ports.get(timeout=60)
        self._channel = grpc.insecure_channel(
            f"localhost:{port}", options=[("grpc.max_receive_message_length", -1)])
        self._echo = self._channel.unary_unary("/bench.Echo/Echo")
        self._big = self._channel.unary_unary("/bench.Echo/Big")
        for _ in range(200):  # connect and warm up
            self._echo(b"x", timeout=10)

    def round_trips_per_s(self, seconds: float) -> float:
        """Sequential unary round trips of one byte (the per-RPC cost the service amortises)."""
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            for _ in range(100):
                self._echo(b"x", timeout=10)
            calls += 100
        return calls / elapsed

    def big_mb_per_s(self, total: int) -> float:
        """Sequential 16 MB unary replies: what gRPC alone moves, with nothing else to do."""
        self._big(b"", timeout=30)
        count = max(2, total // (16 * MB))
        start = time.perf_counter()
        for _ in range(count):
            self._big(b"", timeout=30)
        return count * 16 * MB / MB / (time.perf_counter() - start)

    def close(self) -> None:
        self._channel.close()
        self._stop.set()
        self._server.join(10)


def _tcp_receiver(port: int, chunk: int, total: int) -> None:
    with socket.create_connection(("localhost", port)) as sock:
        buffer = memoryview(bytearray(chunk))
        received = 0
        while received < total:
            n = sock.recv_into(buffer, min(chunk, total - received))
            if n == 0:
                raise ConnectionError("sender closed early")
            received += n
        sock.sendall(b"k")


def tcp_mb_per_s(total: int, chunk: int = 16 * MB) -> float:
    """Raw loopback bandwidth: sendall of big buffers to recv_into in another process."""
    total = max(1, total // chunk) * chunk
    ctx = multiprocessing.get_context("spawn")
    with socket.create_server(("localhost", 0)) as listener:
        port = listener.getsockname()[1]
        receiver = ctx.Process(target=_tcp_receiver, args=(port, chunk, total + chunk),
                               daemon=True)
        receiver.start()
        conn, _ = listener.accept()
    with conn:
        data = memoryview(bytearray(os.urandom(chunk)))
        conn.sendall(data)  # warm up: page in both buffers, grow the socket windows
        start = time.perf_counter()
        sent = 0
        while sent < total:
            conn.sendall(data)
            sent += chunk
        conn.recv(1)
        elapsed = time.perf_counter() - start
    receiver.join(10)
    return total / MB / elapsed


# ============================================================================ the service


class Cluster:
    """A dispatcher and one worker as subprocesses (the CLI), stopped with SIGTERM."""

    def __init__(self, processes: int) -> None:
        self._procs: list[subprocess.Popen] = []
        ports = [free_port(), free_port()] if METRICS else []
        metrics = [["--metrics-port", str(p)] for p in ports] or [[], []]
        self.address = self._spawn(["dispatcher", "--port", "0", *metrics[0]])
        self._spawn(["worker", "--dispatcher", self.address, "--processes", str(processes),
                     *metrics[1]])
        self._scraping = threading.Event()
        if ports:
            threading.Thread(target=self._scrape, args=(ports,), daemon=True).start()

    def _scrape(self, ports: list[int]) -> None:
        """What a Prometheus server would do, only more often."""
        import urllib.request

        while not self._scraping.wait(0.5):
            for port in ports:
                with contextlib.suppress(OSError):
                    urllib.request.urlopen(f"http://localhost:{port}/metrics", timeout=2).read()

    @property
    def pids(self) -> list[int]:
        """The servers' process ids (their executors are their children)."""
        return [proc.pid for proc in self._procs]

    def _spawn(self, args: list[str]) -> str:
        try:
            proc, address = spawn_server(args)
        except RuntimeError:
            self.close()
            raise
        self._procs.append(proc)
        return address

    def close(self) -> None:
        if hasattr(self, "_scraping"):
            self._scraping.set()
        stop_servers(self._procs)
        self._procs.clear()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_clusters(processes: list[int], stack: contextlib.ExitStack) -> dict[int, Cluster]:
    """One cluster per executor count, started at once: their start-ups overlap."""
    with ThreadPoolExecutor() as pool:
        futures = {n: pool.submit(Cluster, n) for n in processes}
    clusters, errors = {}, []
    for n, future in futures.items():
        try:
            clusters[n] = stack.enter_context(future.result())
        except Exception as error:
            errors.append(error)
    if errors:
        raise errors[0]
    return clusters


def timed_read(elements: Iterator, warmup: int, size_of: Callable | None = None
               ) -> tuple[float, float]:
    """(elements/s, bytes/s) of `elements` from the `warmup`-th one to the last one."""
    count, size, start, end = 0, 0, 0.0, 0.0
    for element in elements:
        count += 1
        if count == warmup:
            start = time.perf_counter()
        elif count > warmup:
            size += size_of(element) if size_of else 0
        end = time.perf_counter()
    if count <= warmup + 1:
        raise RuntimeError(f"read only {count} elements, fewer than the warm-up of {warmup}")
    elapsed = end - start
    return (count - warmup) / elapsed, size / elapsed


class Blob:
    """A map fn returning one random uint8 tensor of `size` bytes, made once per replica."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._tensor = None

    def __call__(self, _index: int):
        import torch

        if self._tensor is None:
            self._tensor = torch.randint(0, 256, (self.size,), dtype=torch.uint8)
        return self._tensor


class Spin:
    """A CPU-bound pure-Python map: `loops` iterations of integer arithmetic (GIL held)."""

    def __init__(self, loops: int) -> None:
        self.loops = loops

    def __call__(self, index: int) -> int:
        total = index
        for i in range(self.loops):
            total = (total * 31 + i) % 1_000_003
        return total


def _spin_worker(loops: int, count: int, go: multiprocessing.Event,
                 spans: multiprocessing.Queue) -> None:
    spin = Spin(loops)
    spans.put(None)  # ready
    go.wait()
    start = time.time()
    for index in range(count):
        spin(index)
    spans.put((start, time.time()))


def bare_processes_rate(loops: int, count: int, processes: int) -> float:
    """Elements/s of `processes` plain processes running the map: what the cores allow now."""
    ctx = multiprocessing.get_context("spawn")
    go, spans = ctx.Event(), ctx.Queue()
    workers = [ctx.Process(target=_spin_worker, args=(loops, count, go, spans), daemon=True)
               for _ in range(processes)]
    for worker in workers:
        worker.start()
    for _ in workers:  # all booted, so start-up is not timed
        spans.get(timeout=120)
    go.set()
    times = [spans.get(timeout=120) for _ in workers]
    for worker in workers:
        worker.join(10)
    return processes * count / (max(end for _, end in times) - min(s for s, _ in times))


def calibrate_spin(ms: float) -> int:
    loops = 10_000
    while True:
        start = time.perf_counter()
        Spin(loops)(0)
        elapsed = time.perf_counter() - start
        if elapsed > 0.05:
            break
        loops *= 2
    best = min(_time(Spin(loops)) for _ in range(3))  # least disturbed by other load
    return max(1, int(loops * ms / 1000 / best))


def _time(fn: Callable[[int], object]) -> float:
    start = time.perf_counter()
    fn(0)
    return time.perf_counter() - start


class MatmulMap:
    """A tensor-op map: `loops` 96x96 matmuls on one torch thread (as torch's DataLoader workers
    run); returns a 64x64 float32 tensor (16 KB), or one float of it with `scalar`."""

    def __init__(self, loops: int, scalar: bool = False) -> None:
        self.loops = loops
        self.scalar = scalar

    def __call__(self, index: int):
        import torch

        torch.set_num_threads(1)
        a = torch.full((96, 96), 1.0 / (1 + index % 7))
        for _ in range(self.loops):
            a = torch.tanh(a @ a)
        return float(a[0, 0]) if self.scalar else a[:64, :64].contiguous()

    # torch's DataLoader reads a map-style dataset: the same map as __getitem__.
    def __getitem__(self, index: int):
        return self(index)

    def __len__(self) -> int:
        return 1 << 30


def calibrate_matmul(ms: float) -> int:
    """Matmuls for ~`ms` of CPU per element (process CPU time: robust to a busy machine)."""
    import torch

    threads = torch.get_num_threads()
    loops = 50
    MatmulMap(loops)(0)  # warm up
    best = min(_cpu_time(MatmulMap(loops)) for _ in range(5))
    torch.set_num_threads(threads)
    return max(1, round(loops * ms / 1000 / best))


def _cpu_time(fn: Callable[[int], object]) -> float:
    start = time.process_time()
    fn(0)
    return time.process_time() - start


def cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system) so far of this process (not its children), `pids` and their
    descendants; 0 without psutil (an optional extra)."""
    try:
        import psutil
    except ImportError:
        return 0.0
    own = psutil.Process().cpu_times()
    total = own.user + own.system
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for proc in (root, *root.children(recursive=True)):
                times = proc.cpu_times()
                total += times.user + times.system
        except psutil.Error:
            pass
    return total


def metered_read(elements: Iterator, warmup: int, pids: list[int]) -> tuple[float, float]:
    """(elements/s, ms of CPU per element over `pids`) of `elements` after `warmup`."""
    count = 0
    cpu = 0.0
    for count, _ in enumerate(elements, 1):
        if count == warmup:
            cpu, start = cpu_seconds(pids), time.perf_counter()
    elapsed = time.perf_counter() - start
    done = count - warmup
    return done / elapsed, 1000 * (cpu_seconds(pids) - cpu) / done


def run_tensor_map(settings: Settings, rounds: int, cluster: Cluster, log: Callable
                   ) -> dict[str, float]:
    """Elements/s of the tensor-op map (best of `rounds` interleaved rounds) and ms of CPU per
    element over every process involved (least of the rounds): ours and torch's DataLoader,
    for each output ("tensor", "float")."""
    import torch

    loops = calibrate_matmul(TENSOR_MAP_MS)
    best: dict[str, float] = {}
    for output in ("tensor", "float"):
        fn = MatmulMap(loops, scalar=output == "float")
        for key, value in _tensor_map_rounds(settings, rounds, cluster, fn).items():
            best[f"{output}/{key}"] = value
        log(f"(d) {output}: service {best[f'{output}/ours']:,.0f}/s "
            f"({best[f'{output}/ours_cpu']:.2f} ms CPU/element), torch DataLoader "
            f"{best[f'{output}/torch']:,.0f}/s ({best[f'{output}/torch_cpu']:.2f} ms CPU/"
            f"element); {loops} matmuls, torch {torch.__version__}")
    return best


def _tensor_map_rounds(settings: Settings, rounds: int, cluster: Cluster, fn: MatmulMap
                       ) -> dict[str, float]:
    import itertools

    from torch.utils.data import DataLoader

    import torch_dataservice as tds

    n = settings.tensor_elements
    loader = DataLoader(fn, batch_size=None, num_workers=2, persistent_workers=True,
                        sampler=range(10**9))
    loader_iter = iter(loader)
    next(loader_iter)  # start its workers
    torch_pids = [w.pid for w in loader_iter._workers]  # noqa: SLF001
    best = {"ours": 0.0, "torch": 0.0, "ours_cpu": float("inf"), "torch_cpu": float("inf")}
    for _ in range(rounds):
        rate, cpu = metered_read(itertools.islice(loader_iter, n + settings.warmup),
                                 settings.warmup, torch_pids)
        best["torch"], best["torch_cpu"] = max(best["torch"], rate), min(best["torch_cpu"], cpu)
        pipeline = tds.Pipeline.range(settings.warmup + n).map(fn)
        rate, cpu = metered_read(service_reader(cluster.address, pipeline, None),
                                 settings.warmup, cluster.pids)
        best["ours"], best["ours_cpu"] = max(best["ours"], rate), min(best["ours_cpu"], cpu)
    del loader_iter
    return best


BATCH = 256  # (e): elements per batch and per DYNAMIC split


def service_reader(address: str, pipeline, compression: str | None,
                   mode: str = "parallel_epochs") -> Iterator:
    import torch_dataservice as tds

    return iter(pipeline.apply(tds.distribute(mode, f"grpc://{address}",
                                              target_workers=TARGET_WORKERS,
                                              compression=compression)))


# ============================================================================ tf.data service


def run_tensorflow(settings: Settings, spin_loops: int, log: Callable[[str], None]
                   ) -> dict[str, float]:
    """The same workloads through tf.data service; {} if tensorflow is not importable."""
    try:
        import tensorflow as tf
    except ImportError:
        log("tf.data service: skipped (tensorflow is not importable; it is optional)")
        return {}
    results: dict[str, float] = {}
    tf.get_logger().setLevel("ERROR")
    spin_loops = spin_loops or calibrate_spin(MAP_MS)

    def read(dataset, processes: int, compression, size: int = 0,
             warmup: int = settings.warmup) -> tuple[float, float]:
        dispatcher = tf.data.experimental.service.DispatchServer()
        address = dispatcher.target.split("://")[1]
        workers = [tf.data.experimental.service.WorkerServer(
            tf.data.experimental.service.WorkerConfig(dispatcher_address=address))]
        del processes  # tf.data workers are one process; map parallelism is num_parallel_calls
        try:
            distributed = dataset.apply(tf.data.experimental.service.distribute(
                "parallel_epochs", dispatcher.target, compression=compression))
            return timed_read(iter(distributed), warmup,
                              (lambda e: size) if size else None)
        finally:
            for worker in workers:
                worker._stop()
            dispatcher._stop()

    rate, _ = read(tf.data.Dataset.range(settings.tiny_elements), 1, None,
                   warmup=settings.warmup * 100)
    results["tiny"] = rate
    for size in (1 * MB, 16 * MB):
        blob = tf.random.uniform((size,), 0, 255, dtype=tf.int32)
        blob = tf.cast(blob, tf.uint8)
        n = max(settings.warmup + 10, settings.big_bytes_total // size)
        for compression in (None, "AUTO"):
            dataset = tf.data.Dataset.range(n).map(lambda _i, b=blob: b)
            _, bps = read(dataset, 1, compression, size)
            results[f"{size // MB}MB/{compression}"] = bps / MB
    spin = Spin(spin_loops)
    for calls in (1, 2):
        dataset = tf.data.Dataset.range(settings.map_elements).map(
            lambda i: tf.py_function(lambda x: spin(int(x)), [i], tf.int64),
            num_parallel_calls=calls)
        rate, _ = read(dataset, calls, None)
        results[f"map{calls}"] = rate
    return results


# ============================================================================ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Each figure and its baseline are measured --rounds times, interleaved, and the "
               "best of each is kept: the run least disturbed by other load on the machine.")
    parser.add_argument("--quick", action="store_true", help="short runs (< 60 s in all)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="measurements of each figure (default: 2 quick, 4 full)")
    parser.add_argument("--processes", type=int, default=1,
                        help="executor processes of the worker for (a) and (b) (default 1)")
    parser.add_argument("--only", choices=("a", "b", "c", "d", "e"), action="append",
                        help="run only these sections (repeatable)")
    parser.add_argument("--target-workers", choices=("AUTO", "ANY"), default="AUTO",
                        help="AUTO reads the worker through its Unix socket (same host), ANY "
                             "over TCP like a remote trainer (default AUTO)")
    parser.add_argument("--metrics", action="store_true",
                        help="servers serve /metrics, scraped every 0.5 s (compare with and "
                             "without: the cost of metrics)")
    args = parser.parse_args(argv)
    global TARGET_WORKERS, METRICS
    TARGET_WORKERS = args.target_workers
    METRICS = args.metrics
    settings = QUICK if args.quick else FULL
    rounds = args.rounds or settings.rounds
    sections = set(args.only or ("a", "b", "c", "d", "e"))
    began = time.perf_counter()

    import torch

    import torch_dataservice as tds

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - began:6.1f}s] {message}", flush=True)

    def best(results: dict, key: object, value: float) -> None:
        results[key] = max(results.get(key, 0.0), value)

    rows: list[Row] = []
    spin_loops = calibrate_spin(MAP_MS) if "c" in sections else 0
    ours: dict = {}  # figure key -> best value
    base: dict = {}  # baseline key -> best value

    needed = ({args.processes} if sections & {"a", "b", "e"} else set()) | (
        {1, 2} if "c" in sections else set()) | ({2} if "d" in sections else set())
    with contextlib.ExitStack() as stack:
        clusters = start_clusters(sorted(needed), stack)
        if sections & {"a", "b"}:
            cluster = clusters[args.processes]
            grpc_baseline = GrpcBaseline()
            stack.callback(grpc_baseline.close)
            for round_index in range(rounds):
                log(f"round {round_index + 1}/{rounds} of (a) and (b)")
                if "a" in sections:
                    best(base, "rtt", grpc_baseline.round_trips_per_s(settings.seconds))
                    pipeline = tds.Pipeline.range(settings.tiny_elements)
                    rate, _ = timed_read(service_reader(cluster.address, pipeline, None),
                                         settings.warmup * 100)
                    best(ours, "tiny", rate)
                    log(f"  gRPC round trips {base['rtt']:,.0f}/s, tiny elements {rate:,.0f}/s")
                if "b" in sections:
                    best(base, "tcp", tcp_mb_per_s(settings.tcp_bytes_total))
                    best(base, "grpc16", grpc_baseline.big_mb_per_s(settings.big_bytes_total))
                    for size in (1 * MB, 16 * MB):
                        n = settings.warmup + max(10, settings.big_bytes_total // size)
                        for compression in (None, "AUTO"):
                            pipeline = tds.Pipeline.range(n).map(Blob(size))
                            _, bps = timed_read(
                                service_reader(cluster.address, pipeline, compression),
                                settings.warmup, lambda t: t.numel() * t.element_size())
                            best(ours, (size, compression), bps / MB)
                            log(f"  {size // MB} MB, compression={compression}: "
                                f"{bps / MB:,.0f} MB/s")
                    log(f"  raw TCP {base['tcp']:,.0f} MB/s, bare gRPC 16 MB replies "
                        f"{base['grpc16']:,.0f} MB/s (best so far)")

        for round_index in range(rounds) if "e" in sections else ():
            log(f"round {round_index + 1}/{rounds} of (e)")
            n = settings.tiny_elements * 10
            for mode in ("parallel_epochs", "distributed_epoch"):
                pipeline = tds.Pipeline.range(n).with_split_size(BATCH).batch(BATCH)
                rate, _ = timed_read(service_reader(clusters[args.processes].address, pipeline,
                                                    None, mode), settings.warmup)
                best(ours, f"batched/{mode}", rate * BATCH)
                log(f"  batch({BATCH}), {mode}: {rate * BATCH:,.0f} elements/s")

        if "c" in sections:
            spin = Spin(spin_loops)
            n = settings.map_elements
            for round_index in range(rounds):
                log(f"round {round_index + 1}/{rounds} of (c)")
                local, _ = timed_read(iter(tds.Pipeline.range(n // 2).map(spin)), 5)
                best(base, "local", local)
                for processes in (1, 2):  # the same work in plain processes, no service
                    best(base, f"bare{processes}",
                         bare_processes_rate(spin_loops, n // 2, processes))
                for processes in (1, 2):
                    pipeline = tds.Pipeline.range(settings.warmup + n * processes).map(spin)
                    rate, _ = timed_read(
                        service_reader(clusters[processes].address, pipeline, None),
                        settings.warmup)
                    best(ours, f"map{processes}", rate)
                log(f"  local {local:,.1f}/s ({1000 / local:.1f} ms/element); best so far: "
                    f"service 1 process {ours['map1']:,.1f}/s, 2 processes "
                    f"{ours['map2']:,.1f}/s; bare 1 process {base['bare1']:,.1f}/s, "
                    f"2 processes {base['bare2']:,.1f}/s")

        if "d" in sections:
            tensor_map = run_tensor_map(settings, rounds, clusters[2], log)

    if "a" in sections:
        rows.append(Row("(a) tiny elements", ours["tiny"], "elem/s", "gRPC unary RTT",
                        base["rtt"], "call/s", ours["tiny"] / base["rtt"], "x", 10.0))
    if "b" in sections:
        for key, mbps in ours.items():
            if not isinstance(key, tuple):
                continue
            size, compression = key
            rows.append(Row(
                f"(b) {size // MB} MB, {compression}", mbps, "MB/s", "raw TCP", base["tcp"],
                "MB/s", 100 * mbps / base["tcp"], "%",
                40.0 if (size, compression) == (16 * MB, None) else None))
        rows.append(Row("(b) bare gRPC 16 MB", base["grpc16"], "MB/s", "raw TCP",
                        base["tcp"], "MB/s", 100 * base["grpc16"] / base["tcp"], "%", None))
        rows.append(Row("(b) 16 MB, None", ours[(16 * MB, None)], "MB/s", "bare gRPC 16 MB",
                        base["grpc16"], "MB/s",
                        100 * ours[(16 * MB, None)] / base["grpc16"], "%", None))
    if "c" in sections:
        for processes in (1, 2):
            rate = ours[f"map{processes}"]
            rows.append(Row(f"(c) map, {processes} proc", rate, "elem/s", "local map",
                            base["local"], "elem/s", rate / base["local"], "x", None))
        rows.append(Row("(c) map 2 proc vs 1", ours["map2"], "elem/s", "1 proc", ours["map1"],
                        "elem/s", ours["map2"] / ours["map1"], "x", 1.7))
        # What the machine allowed in the same run: 2 plain processes vs 1, no service at all.
        rows.append(Row("(c) bare 2 proc vs 1", base["bare2"], "elem/s", "bare 1 proc",
                        base["bare1"], "elem/s", base["bare2"] / base["bare1"], "x", None))

    if "e" in sections:
        dynamic, parallel = ours["batched/distributed_epoch"], ours["batched/parallel_epochs"]
        rows.append(Row(f"(e) batch({BATCH}) DYNAMIC", dynamic, "elem/s", "parallel_epochs",
                        parallel, "elem/s", dynamic / parallel, "x", 0.7))

    for output in ("tensor", "float") if "d" in sections else ():
        got = {key.split("/")[1]: value for key, value in tensor_map.items()
               if key.startswith(output)}
        rows.append(Row(f"(d) {output} map, 2 proc", got["ours"], "elem/s",
                        "torch DataLoader x2", got["torch"], "elem/s",
                        got["ours"] / got["torch"], "x", 0.95))
        if got["torch_cpu"]:  # CPU per element of every process: what a busy machine hides
            rows.append(Row(f"(d) {output} CPU/element", got["ours_cpu"], "ms",
                            "torch DataLoader", got["torch_cpu"], "ms",
                            got["torch_cpu"] / got["ours_cpu"], "x", None))

    tf_results = run_tensorflow(settings, spin_loops, log) if sections - {"d"} else {}
    comparisons = [("tiny", "tiny", "tiny elements", "elem/s")]
    comparisons += [((size, c), f"{size // MB}MB/{c}", f"{size // MB} MB, {c}", "MB/s")
                    for size in (1 * MB, 16 * MB) for c in (None, "AUTO")]
    comparisons += [(f"map{p}", f"map{p}", f"map, {p} proc", "elem/s") for p in (1, 2)]
    for key, tf_key, label, unit in comparisons:
        if key in ours and tf_key in tf_results:
            rows.append(Row(f"tf: {label}", ours[key], unit, "tf.data service",
                            tf_results[tf_key], unit, ours[key] / tf_results[tf_key], "x", None))

    print()
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f}, {'quick' if args.quick else 'full'} mode, {rounds} rounds, "
          f"target_workers={TARGET_WORKERS}, metrics={'on' if METRICS else 'off'}, "
          f"{time.perf_counter() - began:.0f} s")
    header = f"{'figure':<22} {'value':>17}  {'baseline':<33} {'ratio':>7} {'target':>7}  ok"
    print(header)
    print("-" * len(header))
    for row in rows:
        digits = 2 if row.unit == "ms" else 0
        value = f"{row.value:,.{digits}f} {row.unit}"
        baseline = f"{row.baseline} {row.baseline_value:,.{digits}f} {row.baseline_unit}"
        ratio = f"{row.ratio:.2f}x" if row.ratio_unit == "x" else f"{row.ratio:.1f}%"
        target = "-" if row.target is None else f">={row.target:g}{row.ratio_unit}"
        print(f"{row.figure:<22} {value:>17}  {baseline:<33} {ratio:>7} {target:>7}  {row.ok()}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())

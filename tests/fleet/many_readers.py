"""Many real readers on the fleet: one journaled dispatcher (host a), 4 workers (w1..w4) and
PROCESSES trainer processes of THREADS reader threads each (tests/fleet/reader_threads.py, on
t1..t4), all reading one DYNAMIC epoch of range(N) under one job name. Meanwhile the
dispatcher is sampled: its status and metrics from host a (tests/fleet/status_sampler.py),
its CPU from /proc/PID/stat here (the fleet shares the machine's pid namespace).

`run_readers` runs it and returns what was seen; `measure` turns that into figures over the
window in which every reader was attached: the dispatcher's cores and RPC/s, the intervals
it announced, and the interval each reader actually used, counted at the dispatcher (a
reader's heartbeat age drops when it beats; the status is polled faster than the intervals).
Used by tests/fleet/test_fleet_readers.py and benchmarks/fleet_readers.py.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.fault.helpers import tally_all
from tests.fleet.hosts import Fleet, HostProcess
from torch_dataservice.dispatcher.cadence import (
    CLIENT_DEFAULT_S,
    MAX_CLIENT_INTERVAL_S,
    MAX_WORKER_INTERVAL_S,
    WORKER_DEFAULT_S,
    interval_ms,
    population_stretch,
)

HOSTS = ("a", "w1", "w2", "w3", "w4", "t1", "t2", "t3", "t4")
WORKER_HOSTS = ("w1", "w2", "w3", "w4")
TRAINER_HOSTS = ("t1", "t2", "t3", "t4")
DISPATCHER_PORT, WORKER_PORT, DATA_PORT, METRICS_PORT = 5000, 5001, 5002, 9100
JOB = "many-readers"
TOKEN = "many-readers-token"  # servers bound to 0.0.0.0 need one
CPU_PERIOD_S = 0.25


@dataclass
class Run:
    """What one run left: outputs, samples, the dispatcher's CPU over time."""

    n: int
    readers: int
    budget_rps: int
    outs: list[Path]
    status: list[dict]  # status_sampler's status lines
    metrics: list[dict]  # ... and its metrics lines
    cpu: list[tuple[float, float]]  # (unix time, dispatcher CPU seconds)
    reader_rss_mb: list[float]  # peak, per trainer process
    dispatcher_rss_mb: float
    worker_rss_mb: float  # all 4 workers with their executor processes
    seconds: float  # from go to the last reader's exit
    outputs: dict[str, str] = field(default_factory=dict)  # per process, for failures


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _rss_mb(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            pass
    return total / 1024


def _group(pgid: int) -> list[int]:
    """The processes of process group `pgid` (a worker and its executors)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[2]) == pgid:
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def start_service(fleet: Fleet, budget_rps: int | None) -> tuple[HostProcess, str]:
    """The journaled dispatcher on host a (its journal on the shared disk) and the 4 workers,
    serving; returns the dispatcher and its target."""
    extra = ["--heartbeat-budget-rps", str(budget_rps)] if budget_rps else []
    dispatcher = fleet["a"].spawn(
        "dispatcher", "--host", "0.0.0.0", "--port", str(DISPATCHER_PORT), "--fault-tolerant",
        "--work-dir", str(fleet.shared / "journal"), "--metrics-port", str(METRICS_PORT),
        *extra, env=fleet.env(TORCH_DATASERVICE_TOKEN=TOKEN))
    dispatcher.wait_serving()
    target = f"grpc://{fleet['a'].address}:{DISPATCHER_PORT}"
    workers = [fleet[name].spawn(
        "worker", "--dispatcher", target, "--host", "0.0.0.0", "--port", str(WORKER_PORT),
        "--data-port", str(DATA_PORT), "--processes", "1",
        env=fleet.env(TORCH_DATASERVICE_TOKEN=TOKEN)) for name in WORKER_HOSTS]
    for worker in workers:
        worker.wait_serving()
    return dispatcher, target


def run_readers(fleet: Fleet, n: int, processes: int = 8, threads: int = 8,
                rate: float = 0.0, budget_rps: int | None = None, period_s: float = 0.1,
                timeout_s: float = 120.0) -> Run:
    """One epoch of range(n) read by processes x threads readers of one DYNAMIC job (each
    reader at most `rate` elements/s), the dispatcher's status polled every `period_s`."""
    dispatcher, target = start_service(fleet, budget_rps)
    stop_cpu = threading.Event()
    cpu: list[tuple[float, float]] = []

    def sample_cpu() -> None:
        while not stop_cpu.is_set():
            cpu.append((time.time(), _cpu_seconds(dispatcher.proc.pid)))
            stop_cpu.wait(CPU_PERIOD_S)

    assert b"dispatcher" in Path(f"/proc/{dispatcher.proc.pid}/cmdline").read_bytes()
    sampled, stop = fleet.shared / "status.jsonl", fleet.shared / "stop"
    a = fleet["a"]
    sampler = a.spawn(argv=[
        sys.executable, "-m", "tests.fleet.status_sampler", f"{a.address}:{DISPATCHER_PORT}",
        f"http://{a.address}:{METRICS_PORT}/metrics", str(period_s), str(sampled), str(stop),
        str(timeout_s + 60)], env=fleet.env(TORCH_DATASERVICE_TOKEN=TOKEN))
    sampler.wait_line("sampling", 30)
    cpu_thread = threading.Thread(target=sample_cpu, daemon=True)
    cpu_thread.start()
    go = fleet.shared / "go"
    outs_dir = fleet.shared / "reads"
    outs_dir.mkdir()
    readers = [fleet[TRAINER_HOSTS[p % len(TRAINER_HOSTS)]].spawn(argv=[
        sys.executable, "-m", "tests.fleet.reader_threads", target, str(n), str(threads), JOB,
        str(outs_dir / f"p{p}"), str(go), str(rate)], env=fleet.env(TORCH_DATASERVICE_TOKEN=TOKEN))
        for p in range(processes)]
    try:
        for reader in readers:
            reader.wait_line("ready", 60)
        began = time.monotonic()
        go.touch()
        deadline = time.monotonic() + timeout_s
        for reader in readers:
            reader.wait_line("peak rss", max(1.0, deadline - time.monotonic()))
            reader.wait_exit(60)  # threads done: only its exit is left
        seconds = time.monotonic() - began
        dispatcher_rss = _rss_mb([dispatcher.proc.pid])
        worker_rss = _rss_mb([pid for w in fleet.processes if w.args[:1] == ["worker"]
                              for pid in _group(w.proc.pid)])
    finally:
        stop.touch()
        stop_cpu.set()
        cpu_thread.join(5)
    sampler.wait_exit(30)
    lines = [json.loads(line) for line in sampled.read_text().splitlines()]
    return Run(
        n=n, readers=processes * threads, budget_rps=budget_rps or 0,
        outs=[outs_dir / f"p{p}.{t}" for p in range(processes) for t in range(threads)],
        status=[line for line in lines if "load" in line],
        metrics=[line for line in lines if "metrics" in line], cpu=cpu,
        reader_rss_mb=[float(line.split()[2]) for r in readers for line in r.lines
                       if line.startswith("peak rss")],
        dispatcher_rss_mb=dispatcher_rss, worker_rss_mb=worker_rss, seconds=seconds,
        outputs={f"reader {i}": r.output for i, r in enumerate(readers)}
        | {"dispatcher": dispatcher.output})


def parts(run: Run) -> list[list[int]]:
    """What each reader read, in its order (a reader that did not end cleanly: AssertionError)."""
    read = []
    for out in run.outs:
        lines = out.read_text().splitlines() if out.exists() else []
        assert lines and lines[-1] == "done", f"{out.name} did not end cleanly"
        read.append([int(line) for line in lines[:-1]])
    return read


@dataclass
class Figures:
    """The dispatcher over the window in which every reader was attached."""

    window_s: float
    cores: float  # its CPU seconds per second, from /proc
    reported_cores: float  # what it reported itself (status load.cores), mean
    rpcs_per_s: float  # answered, as it reported (status load.rpcs_per_s), mean
    metrics_rpcs_per_s: float  # tds_dispatcher_rpcs_per_second, mean
    status_polls_per_s: float  # the sampler's own GetClusterStatus calls, counted in
    splits_per_s: float  # DYNAMIC splits handed
    worker_interval_ms: float  # in force (mean over the window; the default when 0)
    client_interval_ms: float
    predicted_client_ms: float  # cadence: the population stretch alone, for this fleet
    predicted_worker_ms: float
    stretch: float  # the most the dispatcher stretched over the window
    refused_per_s: float
    reader_ratios: list[float]  # per reader: its intervals / those announced (median)
    max_age_s: float  # the longest any reader was silent, as sampled


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def measure(run: Run, workers: int = len(WORKER_HOSTS)) -> Figures:
    full = [s for s in run.status if any(
        it["clients"] == run.readers for it in s["iterations"])]
    assert len(full) >= 2, (f"the status never showed {run.readers} readers attached "
                            f"together in {len(run.status)} samples")
    t0, t1 = full[0]["t"], full[-1]["t"]
    window = t1 - t0
    (cpu0, c0), (cpu1, c1) = (min(run.cpu, key=lambda s: abs(s[0] - t)) for t in (t0, t1))
    loads = [s["load"] for s in full]
    metrics = [m["metrics"] for m in run.metrics if t0 <= m["t"] <= t1]
    splits = [sum(it["splits_handed"] for it in s["iterations"]) for s in (full[0], full[-1])]
    intervals = reader_intervals(run.status)
    stretch = population_stretch(workers, run.readers, run.budget_rps or 500)
    return Figures(
        window_s=window, cores=(c1 - c0) / max(1e-6, cpu1 - cpu0),
        reported_cores=_mean([load["cores"] for load in loads]),
        rpcs_per_s=_mean([load["rpcs_per_s"] for load in loads]),
        metrics_rpcs_per_s=_mean([m.get("tds_dispatcher_rpcs_per_second", float("nan"))
                                  for m in metrics]),
        status_polls_per_s=(len(full) - 1) / window, splits_per_s=(splits[1] - splits[0]) / window,
        worker_interval_ms=_mean([load["worker_heartbeat_ms"] or WORKER_DEFAULT_S * 1000
                                  for load in loads]),
        client_interval_ms=_mean([load["client_heartbeat_ms"] or CLIENT_DEFAULT_S * 1000
                                  for load in loads]),
        predicted_client_ms=(interval_ms(CLIENT_DEFAULT_S, stretch, MAX_CLIENT_INTERVAL_S)
                             or CLIENT_DEFAULT_S * 1000),
        predicted_worker_ms=(interval_ms(WORKER_DEFAULT_S, stretch, MAX_WORKER_INTERVAL_S)
                             or WORKER_DEFAULT_S * 1000),
        stretch=max(load["stretch"] for load in loads),
        refused_per_s=_mean([load["refused_per_s"] for load in loads]),
        reader_ratios=list(intervals.values()),
        max_age_s=max(age for s in run.status for age in s["ages"].values()))


def reader_intervals(status: list[dict]) -> dict[str, float]:
    """Per reader (client id) seen beating at least 3 times: the median of its intervals
    between heartbeats as the dispatcher saw them, each divided by the interval the dispatcher
    announced when the first of the two beats was answered (1: as asked). A beat is a drop of
    the reader's heartbeat age between two status samples (so the samples must come faster
    than the beats); it happened at the sample's time minus the age."""
    beats: dict[str, list[tuple[float, float]]] = {}  # client -> (when, announced s)
    previous: dict[str, float] = {}
    for sample in status:
        announced = sample["load"]["client_heartbeat_ms"] / 1000 or CLIENT_DEFAULT_S
        for client, age in sample["ages"].items():
            if client in previous and age < previous[client]:
                beats.setdefault(client, []).append((sample["t"] - age, announced))
        previous = sample["ages"]
    return {client: statistics.median((t1 - t0) / asked for (t0, asked), (t1, _) in
                                      zip(times, times[1:], strict=False))
            for client, times in beats.items() if len(times) >= 3}


def exactly_once(run: Run) -> str:
    """The tally of every reader's output together (tests/fault/helpers.py)."""
    return str(tally_all(run.outs, run.n))

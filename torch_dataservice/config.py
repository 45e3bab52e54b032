"""Server configuration: frozen-at-start dataclasses validated where they are built."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def _check_positive_ms(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value <= 0):
        raise ValueError(f"{name} must be a positive number of milliseconds, got {value!r}")


def _check_port(port: int, name: str = "port") -> None:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"{name} must be an int in [0, 65535], got {port!r}")


WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})
PORT_PLACEHOLDER = "%port%"


def _check_worker_address(address: str | None) -> None:
    """HOST:PORT (PORT may be %port%), and never a wildcard host: clients dial it."""
    if address is None:
        return
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not sep or not host or not (port.isdigit() or port == PORT_PLACEHOLDER):
        raise ValueError(f"worker_address must be HOST:PORT (PORT may be {PORT_PLACEHOLDER}), "
                         f"got {address!r}")
    if host in WILDCARD_HOSTS:
        raise ValueError(f"worker_address {address!r} names no host clients can dial; give "
                         "this host's name or address")


def _check_metrics_port(port: int | None) -> None:
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                             or not 0 <= port <= 65535):
        raise ValueError(f"metrics_port must be None or an int in [0, 65535], got {port!r}")


def _check_protocol(protocol: str) -> None:
    if protocol != "grpc":
        raise ValueError(f"protocol must be 'grpc', got {protocol!r}")


def _check_readable(name: str, path: object) -> str:
    """A path that can be opened now: a typo fails at start, not at the first handshake."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ValueError(f"{name} must be a file path, got {path!r}")
    text = os.fspath(path)
    try:
        with open(text, "rb"):
            pass
    except OSError as error:
        raise ValueError(f"{name} {text!r} cannot be read: {error.strerror or error}") from None
    return text


CLIENT_AUTH = ("required", "none")


@dataclass(frozen=True)
class TLSConfig:
    """A server's TLS identity: PEM `cert_file` and `key_file`. `ca_file` is the CA its
    process trusts when it dials (a CLI worker its dispatcher) and, with
    `client_auth="required"` (the default), also the CA whose certificate every client must
    present (mTLS), which then authenticates them (see auth.check_bind); `"none"` serves TLS
    without asking for client certificates. Files are checked when built so a typo fails at
    start."""

    cert_file: str
    key_file: str
    ca_file: str | None = None
    client_auth: str = "required"

    def __post_init__(self) -> None:
        object.__setattr__(self, "cert_file", _check_readable("cert_file", self.cert_file))
        object.__setattr__(self, "key_file", _check_readable("key_file", self.key_file))
        if self.ca_file is not None:
            object.__setattr__(self, "ca_file", _check_readable("ca_file", self.ca_file))
        if self.client_auth not in CLIENT_AUTH:
            raise ValueError(f"client_auth must be one of {CLIENT_AUTH}, "
                             f"got {self.client_auth!r}")

    @property
    def mutual(self) -> bool:
        """Clients must present a certificate (mTLS)."""
        return self.ca_file is not None and self.client_auth == "required"


def _check_tls(tls: object) -> None:
    if tls is not None and not isinstance(tls, TLSConfig):
        raise ValueError(f"tls must be a TLSConfig or None, got {tls!r}")


JOURNAL_RECOVERY = ("fail", "truncate")


@dataclass
class DispatcherConfig:
    """How a dispatcher runs. `port=0` picks a free port.

    `worker_addresses` fixes the worker list that static sharding (FILE, DATA, FILE_OR_DATA,
    HINT) needs: N is its length and a worker's index is its position. `fault_tolerant_mode`
    journals every state change to `work_dir` so a restarted dispatcher loses nothing.
    `journal_recovery`: a journal damaged in the middle refuses to start ("fail"), or is cut
    at the damage ("truncate": the records after it are lost, and the iterations that were
    running fail rather than hand out data again).
    """

    port: int = 0
    protocol: str = "grpc"
    work_dir: str | None = None
    fault_tolerant_mode: bool = False
    worker_addresses: list[str] | None = None
    job_gc_check_interval_ms: int | None = None
    job_gc_timeout_ms: int | None = None
    worker_timeout_ms: int | None = None
    host: str = "localhost"
    journal_recovery: str = "fail"
    metrics_port: int | None = None  # Prometheus /metrics: None off, 0 a free port
    tls: TLSConfig | None = None  # serve gRPC over TLS (mTLS with a ca_file)
    # The fleet's heartbeats per second the dispatcher aims at (it stretches intervals to
    # fit), and how many requests it handles at once before refusing (dispatcher/cadence.py).
    heartbeat_budget_rps: int | None = None
    max_pending_rpcs: int | None = None
    # What requests may make the dispatcher hold (a refused request names the limit).
    max_dataset_bytes: int = 1 << 30  # one dataset definition (the pickled pipeline)
    max_datasets: int = 10_000  # datasets registered at once
    max_workers: int = 10_000  # workers registered at once

    def __post_init__(self) -> None:
        _check_port(self.port)
        for name in ("max_dataset_bytes", "max_datasets", "max_workers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        _check_tls(self.tls)
        _check_metrics_port(self.metrics_port)
        _check_protocol(self.protocol)
        if self.journal_recovery not in JOURNAL_RECOVERY:
            raise ValueError(f"journal_recovery must be one of {JOURNAL_RECOVERY}, "
                             f"got {self.journal_recovery!r}")
        if self.fault_tolerant_mode and not self.work_dir:
            raise ValueError("fault_tolerant_mode=True requires a work_dir, got work_dir=None")
        if self.worker_addresses is not None:
            addresses = list(self.worker_addresses)
            if not addresses or not all(isinstance(a, str) and a for a in addresses):
                raise ValueError(
                    f"worker_addresses must be a non-empty list of addresses, got {addresses!r}"
                )
            if len(set(addresses)) != len(addresses):
                raise ValueError(f"worker_addresses has duplicates: {addresses!r}")
            self.worker_addresses = addresses
        _check_positive_ms("job_gc_check_interval_ms", self.job_gc_check_interval_ms)
        _check_positive_ms("job_gc_timeout_ms", self.job_gc_timeout_ms)
        _check_positive_ms("worker_timeout_ms", self.worker_timeout_ms)
        for name in ("heartbeat_budget_rps", "max_pending_rpcs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")

    @property
    def effective_heartbeat_budget_rps(self) -> int:
        return self.heartbeat_budget_rps or 500

    @property
    def effective_max_pending_rpcs(self) -> int:
        return self.max_pending_rpcs or 24

    @property
    def effective_worker_timeout_ms(self) -> int:
        return self.worker_timeout_ms or 10_000

    @property
    def effective_job_gc_check_interval_ms(self) -> int:
        return self.job_gc_check_interval_ms or 1_000

    @property
    def effective_job_gc_timeout_ms(self) -> int:
        return self.job_gc_timeout_ms or 300_000


@dataclass
class WorkerConfig:
    """How a worker runs. `dispatcher_address` is `HOST:PORT` (no protocol).

    `worker_address` is what the dispatcher tells clients; `%port%` in it becomes the bound
    gRPC port. By default it is `host:port`, or, when `host` binds every interface (0.0.0.0,
    ::), this host's routable address (serving.advertised_host): never a wildcard.
    `num_processes` is how many OS processes run pipelines (default: all cores; 0 runs them
    in threads of this process, for debugging). `data_port` fixes the TCP port elements are
    also served on (worker/data_port.py; 0: a free one), so a firewall can allow it.
    `drain_timeout_s`: on `drain()` (SIGTERM), how long the worker serves what it holds before
    it hands the rest back to the dispatcher. `executor_torch_threads`: torch's intra-op
    threads in each executor process (1, as torch's DataLoader workers: processes, not threads,
    use the cores; None keeps torch's default).
    """

    dispatcher_address: str
    worker_address: str | None = None
    port: int = 0
    protocol: str = "grpc"
    heartbeat_interval_ms: int | None = None
    dispatcher_timeout_ms: int | None = None
    num_processes: int | None = None
    host: str = "localhost"
    cross_trainer_cache_bytes: int = field(default=1 << 30)
    # Most DYNAMIC splits a task keeps in stock ahead of need (worker/split_budget.py sizes the
    # stock to the GetSplit latency and at least 20 ms of work: many only for tiny splits; at
    # most a sixteenth of an epoch's splits); 0 asks only when a process needs one.
    split_prefetch: int = 64
    data_port: int = 0
    data_port_max_connections: int = 1024  # open at once; more are refused as they come
    drain_timeout_s: float = 30.0
    metrics_port: int | None = None  # Prometheus /metrics: None off, 0 a free port
    executor_torch_threads: int | None = 1
    tls: TLSConfig | None = None  # serve gRPC and the data port over TLS (mTLS with ca_file)

    def __post_init__(self) -> None:
        _check_tls(self.tls)
        _check_metrics_port(self.metrics_port)
        if self.executor_torch_threads is not None and (
                not isinstance(self.executor_torch_threads, int)
                or self.executor_torch_threads < 1):
            raise ValueError(f"executor_torch_threads must be an int >= 1 or None, "
                             f"got {self.executor_torch_threads!r}")
        _check_port(self.data_port, "data_port")
        if (isinstance(self.data_port_max_connections, bool)
                or not isinstance(self.data_port_max_connections, int)
                or self.data_port_max_connections <= 0):
            raise ValueError(f"data_port_max_connections must be a positive int, "
                             f"got {self.data_port_max_connections!r}")
        _check_worker_address(self.worker_address)
        if (isinstance(self.drain_timeout_s, bool)
                or not isinstance(self.drain_timeout_s, (int, float))
                or not 0 <= self.drain_timeout_s < float("inf")):
            raise ValueError(
                f"drain_timeout_s must be a finite number >= 0, got {self.drain_timeout_s!r}")
        if not isinstance(self.dispatcher_address, str) or not self.dispatcher_address:
            raise ValueError(
                f"dispatcher_address must be HOST:PORT, got {self.dispatcher_address!r}")
        if "://" in self.dispatcher_address:
            raise ValueError(
                f"dispatcher_address must be HOST:PORT without a protocol, "
                f"got {self.dispatcher_address!r}"
            )
        _check_port(self.port)
        _check_protocol(self.protocol)
        _check_positive_ms("heartbeat_interval_ms", self.heartbeat_interval_ms)
        _check_positive_ms("dispatcher_timeout_ms", self.dispatcher_timeout_ms)
        if self.num_processes is not None and (
            not isinstance(self.num_processes, int) or self.num_processes < 0
        ):
            raise ValueError(f"num_processes must be an int >= 0, got {self.num_processes!r}")
        if not isinstance(self.split_prefetch, int) or self.split_prefetch < 0:
            raise ValueError(f"split_prefetch must be an int >= 0, got {self.split_prefetch!r}")
        cache_bytes = self.cross_trainer_cache_bytes
        if not isinstance(cache_bytes, int) or cache_bytes <= 0:
            raise ValueError(
                f"cross_trainer_cache_bytes must be a positive int, "
                f"got {self.cross_trainer_cache_bytes!r}"
            )

    @property
    def effective_num_processes(self) -> int:
        if self.num_processes is not None:
            return self.num_processes
        if hasattr(os, "sched_getaffinity"):
            return len(os.sched_getaffinity(0))
        return os.cpu_count() or 1

    @property
    def effective_heartbeat_interval_ms(self) -> int:
        return self.heartbeat_interval_ms or 500

    @property
    def effective_dispatcher_timeout_ms(self) -> int:
        return self.dispatcher_timeout_ms or 60 * 60 * 1000

"""`torch-dataservice dispatcher|worker|status`: the servers as standalone processes, and a
view of a running cluster.

Both run until SIGTERM or SIGINT, then stop cleanly (exit code 0, port released); SIGTERM on a
worker drains it first (see WorkerServer.drain). Every flag of a server also reads the
environment variable TORCH_DATASERVICE_<FLAG> (upper case, dashes as underscores); a flag on
the command line wins. The flags are tables (FLAGS), so a new one is a line, and its variable,
help text and place in `--help` come with it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from torch_dataservice import auth
from torch_dataservice.config import DispatcherConfig, TLSConfig, WorkerConfig
from torch_dataservice.errors import JournalCorruptError
from torch_dataservice.rpc import parse_service
from torch_dataservice.serving import write_port_file
from torch_dataservice.version import version_text

ENV_PREFIX = "TORCH_DATASERVICE_"
DISPATCHER_FILE_LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class Flag:
    """One command-line flag; `kind` is "str", "int", "float" or "bool" (a switch)."""

    name: str
    help: str
    kind: str = "str"
    default: Any = None
    choices: tuple[str, ...] | None = None

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.lstrip("-").upper().replace("-", "_")


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("", "0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


_TYPES: dict[str, Callable[[str], Any]] = {"str": str, "int": int, "float": float,
                                           "bool": _bool}

COMMON = [Flag("--log-level", "logging level: DEBUG, INFO, WARNING, ERROR (default: INFO)",
               default="INFO"),
          Flag("--log-format", "text lines, or one JSON object per line (default: text)",
               default="text", choices=("text", "json"))]
METRICS_PORT = Flag("--metrics-port", "serve Prometheus metrics at http://HOST:PORT/metrics; 0 "
                                      "picks a free port (default: off)", "int")
PORT_FILE = Flag("--port-file", "once serving, write HOST:PORT to this file (atomically: "
                                "other processes never see it half-written)")
TLS_FLAGS = [
    Flag("--tls-cert", "PEM certificate: serve gRPC (and a worker's data port) over TLS; also "
                       "presented when this process dials a server that requires one"),
    Flag("--tls-key", "PEM private key of --tls-cert"),
    Flag("--tls-ca", "PEM CA: trust servers it signed, and (with --tls-client-auth "
                     "required) require client certificates it signed (mTLS; then no token is "
                     "needed beyond loopback)"),
    Flag("--tls-client-auth", "whether a server with --tls-ca requires client certificates: "
                              "required (mTLS, default) or none (TLS only)",
         default="required", choices=("required", "none")),
]
FLAGS: dict[str, list[Flag]] = {
    "dispatcher": [
        Flag("--port", "port to listen on; 0 picks a free one (default: 5000)", "int", 5000),
        Flag("--host", "address to bind (default: localhost; 0.0.0.0: every interface, then "
                       "this host's routable address is advertised)", default="localhost"),
        Flag("--work-dir", "directory for the journal of dispatcher state (fault tolerance)"),
        Flag("--fault-tolerant", "journal every state change to --work-dir and replay it on "
                                 "start", "bool", False),
        Flag("--journal-recovery", "a journal damaged in the middle: refuse to start (fail, "
                                   "default) or cut it at the damage, losing the records after "
                                   "it (truncate)", default="fail", choices=("fail", "truncate")),
        Flag("--worker-addresses", "comma-separated fixed worker list HOST:PORT,... (needed by "
                                   "static sharding: FILE, DATA, FILE_OR_DATA, HINT)"),
        Flag("--worker-timeout-ms", "a worker silent this long is declared dead (default: "
                                    "10000)", "int"),
        Flag("--job-gc-timeout-ms", "an iteration without clients this long is collected "
                                    "(default: 300000)", "int"),
        Flag("--heartbeat-budget-rps", "heartbeats per second the fleet may send: past it, "
                                       "workers and readers are asked to report less often "
                                       "(default: 500)", "int"),
        Flag("--max-pending-rpcs", "requests handled at once: past half of it heartbeats, "
                                   "past it splits are refused with a retry-after (default: "
                                   "24)", "int"),
        Flag("--max-dataset-bytes", "largest dataset definition (pickled pipeline) a client "
                                    "may register (default: 1 GiB)", "int", 1 << 30),
        Flag("--max-datasets", "most datasets registered at once (default: 10000)", "int",
             10_000),
        Flag("--max-workers", "most workers registered at once (default: 10000)", "int",
             10_000),
        PORT_FILE,
        METRICS_PORT,
        *TLS_FLAGS,
    ],
    "worker": [
        Flag("--dispatcher", "dispatcher address HOST:PORT or grpc://HOST:PORT"),
        Flag("--dispatcher-file", "read the dispatcher address from this file, waiting for it "
                                  "to appear (what the dispatcher's --port-file writes)"),
        Flag("--dispatcher-file-timeout-s", "how long to wait for --dispatcher-file (default: "
                                            "600)", "float", 600.0),
        Flag("--port", "gRPC port to listen on; 0 picks a free one (default: 0)", "int", 0),
        Flag("--data-port", "TCP port elements are also served on; 0 picks a free one "
                            "(default: 0)", "int", 0),
        Flag("--data-port-max-connections", "most data-port connections open at once; more "
                                            "are refused as they come (default: 1024)", "int",
             1024),
        Flag("--host", "address to bind (default: localhost; 0.0.0.0: every interface)",
             default="localhost"),
        Flag("--worker-address", "address the dispatcher gives clients; %%port%% is replaced "
                                  "by the gRPC port (default: HOST:PORT, or this host's "
                                  "routable address when HOST is 0.0.0.0)"),
        Flag("--processes", "executor processes that run pipelines (default: all cores)",
             "int"),
        Flag("--heartbeat-interval-ms", "how often to heartbeat the dispatcher (default: 500)",
             "int"),
        Flag("--dispatcher-timeout-ms", "give up a call to the dispatcher after this long "
                                        "(default: 3600000)", "int"),
        Flag("--cross-trainer-cache-bytes", "bytes of the cross-trainer cache window per job "
                                            "(default: 1 GiB)", "int", 1 << 30),
        Flag("--split-prefetch", "most DYNAMIC splits a task keeps in stock ahead of need "
                                 "(default: 64)", "int", 64),
        Flag("--drain-timeout-s", "on SIGTERM, serve what this worker holds for up to this "
                                  "long, then hand the rest back (default: 30)", "float", 30.0),
        Flag("--executor-torch-threads", "torch threads in each executor process (default: 1, "
                                         "as torch's DataLoader workers; 0 keeps torch's "
                                         "default)", "int", 1),
        PORT_FILE,
        METRICS_PORT,
        *TLS_FLAGS,
    ],
    "status": [
        Flag("--dispatcher", "dispatcher address HOST:PORT or grpc://HOST:PORT"),
        Flag("--json", "print JSON instead of tables", "bool", False),
        Flag("--watch", "print again every SECONDS until interrupted", "float"),
    ],
}
HELP = {"dispatcher": "run the dispatcher (control plane)",
        "worker": "run a worker (runs pipelines, serves elements)",
        "status": "show the workers, iterations and clients of a running dispatcher"}


def _add(parser: argparse.ArgumentParser, flag: Flag, suppress: bool = False) -> None:
    """Add `flag`, defaulting to its environment variable (the command line wins)."""
    env = os.environ.get(flag.env)
    default = flag.default
    if suppress:
        default = argparse.SUPPRESS
    elif env is not None:
        try:
            default = _TYPES[flag.kind](env)
        except (ValueError, argparse.ArgumentTypeError):
            parser.error(f"{flag.env}={env!r} is not a valid {flag.kind} for {flag.name}")
        if flag.choices and default not in flag.choices:
            parser.error(f"{flag.env}={env!r}: {flag.name} must be one of {flag.choices}")
    help_text = f"{flag.help} [env {flag.env}]"
    if flag.kind == "bool":
        parser.add_argument(flag.name, nargs="?", const=True, type=_bool, default=default,
                            metavar="BOOL", help=help_text)
    else:
        parser.add_argument(flag.name, type=_TYPES[flag.kind], default=default,
                            choices=flag.choices, help=help_text)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torch-dataservice",
        description="Run a torch_dataservice dispatcher or worker until SIGTERM/SIGINT "
                    "(SIGTERM drains a worker first).")
    parser.add_argument("--version", action="version", version=version_text(),
                        help="print the package, wire protocol and Python versions")
    for flag in COMMON:
        _add(parser, flag)
    commands = parser.add_subparsers(dest="command", required=True)
    for command, flags in FLAGS.items():
        sub = commands.add_parser(command, help=HELP[command], description=HELP[command])
        for flag in COMMON:  # also accepted after the subcommand
            _add(sub, flag, suppress=True)
        for flag in flags:
            _add(sub, flag)
    return parser


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "status" and not args.dispatcher:
        parser.error(f"status: --dispatcher is required (or {Flag('--dispatcher', '').env})")
    if args.command == "worker" and bool(args.dispatcher) == bool(args.dispatcher_file):
        parser.error("worker: give exactly one of --dispatcher and --dispatcher-file "
                     f"(or {Flag('--dispatcher', '').env})")
    return args


def dispatcher_address(text: str) -> str:
    """`HOST:PORT` from what a user or a port file gives: `HOST:PORT` or `grpc://HOST:PORT`."""
    _, address = parse_service(text.strip())
    return address


def wait_for_dispatcher_file(path: str, timeout_s: float, stop: Callable[[], bool]) -> str:
    """The address in `path` once it exists (the dispatcher writes it atomically), logging
    every 10 s while waiting; OSError after `timeout_s` or when `stop()` (a signal)."""
    log = logging.getLogger("torch_dataservice.worker")
    began = last_log = time.monotonic()
    while not stop():
        try:
            with open(path) as source:
                text = source.read().strip()
            if text:
                return dispatcher_address(text)
        except FileNotFoundError:
            pass
        now = time.monotonic()
        if now - began > timeout_s:
            raise OSError(f"no dispatcher address in {path} after {timeout_s:.0f}s "
                          "(--dispatcher-file-timeout-s)")
        if now - last_log >= DISPATCHER_FILE_LOG_EVERY_S:
            log.warning("still waiting for the dispatcher address in %s (%.0fs)", path,
                        now - began)
            last_log = now
        time.sleep(0.2)
    raise InterruptedError(f"stopped while waiting for {path}")


class _Signals:
    """SIGINT stops at once; SIGTERM asks a worker to drain (a second one stops at once)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.drain = threading.Event()
        signal.signal(signal.SIGTERM, self._term)
        signal.signal(signal.SIGINT, lambda signum, frame: self.stop.set())

    def any(self) -> bool:
        return self.stop.is_set() or self.drain.is_set()

    def _term(self, signum: int, frame: Any) -> None:
        (self.stop if self.drain.is_set() else self.drain).set()


def _tls(args: argparse.Namespace) -> TLSConfig | None:
    """The server's TLSConfig from --tls-*; they are also this process's client settings
    (auth.client_tls: a worker dials its dispatcher, the dispatcher its workers)."""
    if not (args.tls_cert or args.tls_key or args.tls_ca):
        return None
    if not (args.tls_cert and args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together (and --tls-ca needs both), got "
                         f"--tls-cert={args.tls_cert!r} --tls-key={args.tls_key!r}")
    tls = TLSConfig(args.tls_cert, args.tls_key, args.tls_ca, args.tls_client_auth)
    os.environ[auth.TLS_CERT_ENV], os.environ[auth.TLS_KEY_ENV] = tls.cert_file, tls.key_file
    if tls.ca_file:
        os.environ[auth.TLS_CA_ENV] = tls.ca_file
    return tls


def _run_dispatcher(args: argparse.Namespace, signals: _Signals) -> int:
    from torch_dataservice.dispatcher.gc_pacing import GcPacing
    from torch_dataservice.dispatcher.server import DispatchServer

    addresses = args.worker_addresses.split(",") if args.worker_addresses else None
    server = DispatchServer(DispatcherConfig(
        port=args.port, host=args.host, work_dir=args.work_dir,
        fault_tolerant_mode=args.fault_tolerant, worker_addresses=addresses,
        journal_recovery=args.journal_recovery, worker_timeout_ms=args.worker_timeout_ms,
        job_gc_timeout_ms=args.job_gc_timeout_ms, metrics_port=args.metrics_port,
        heartbeat_budget_rps=args.heartbeat_budget_rps, max_pending_rpcs=args.max_pending_rpcs,
        max_dataset_bytes=args.max_dataset_bytes, max_datasets=args.max_datasets,
        max_workers=args.max_workers, tls=_tls(args)))
    pacing = GcPacing().install()  # this process is the dispatcher: short GC pauses
    if args.port_file:
        write_port_file(args.port_file, server.address)
    print(f"dispatcher serving at {server.target}", flush=True)
    while not (signals.stop.wait(0.2) or signals.drain.is_set() or server.join(timeout=0)):
        pass
    server.stop()
    pacing.uninstall()
    return 0


def _run_worker(args: argparse.Namespace, signals: _Signals) -> int:
    from torch_dataservice.worker import launch
    from torch_dataservice.worker.server import WorkerServer

    if args.processes != 0:  # now, before gRPC runs: the executors' imports are done here
        launch.start_fork_server_here()
    if args.dispatcher:
        address = dispatcher_address(args.dispatcher)
    else:
        try:
            address = wait_for_dispatcher_file(args.dispatcher_file,
                                               args.dispatcher_file_timeout_s, signals.any)
        except InterruptedError:
            return 0  # asked to stop before it started: nothing to drain
    worker = WorkerServer(WorkerConfig(
        dispatcher_address=address, port=args.port, host=args.host,
        worker_address=args.worker_address, num_processes=args.processes,
        data_port_max_connections=args.data_port_max_connections,
        heartbeat_interval_ms=args.heartbeat_interval_ms,
        dispatcher_timeout_ms=args.dispatcher_timeout_ms, data_port=args.data_port,
        cross_trainer_cache_bytes=args.cross_trainer_cache_bytes,
        split_prefetch=args.split_prefetch, drain_timeout_s=args.drain_timeout_s,
        metrics_port=args.metrics_port, tls=_tls(args),
        executor_torch_threads=args.executor_torch_threads or None))
    announced = False
    while True:
        if worker.registered and not announced:  # "serving" means: the dispatcher accepted it
            announced = True
            if args.port_file:
                write_port_file(args.port_file, worker.address)
            print(f"worker serving at {worker.address} (gRPC port {worker.port}, data port "
                  f"{worker.data_port})", flush=True)
        # Until it is announced, look often: whoever starts the worker waits for that line.
        if (signals.stop.wait(0.2 if announced else 0.01) or signals.drain.is_set()
                or worker.join(timeout=0)):
            break
    if signals.drain.is_set() and not signals.stop.is_set() and worker.refused is None:
        worker.drain(stop=signals.stop)  # SIGTERM: hand back what it holds, then exit 0
    worker.stop()
    if worker.refused is not None:
        print(f"error: the dispatcher refused this worker: {worker.refused}", file=sys.stderr,
              flush=True)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    from torch_dataservice.observability.logs import configure

    configure(args.log_level, args.log_format)
    signals = _Signals()
    try:
        if args.command == "status":
            from torch_dataservice.observability.status_text import show_status

            return show_status(dispatcher_address(args.dispatcher), args.json, args.watch,
                               sys.stdout, signals.stop)
        if args.command == "dispatcher":
            return _run_dispatcher(args, signals)
        code = _run_worker(args, signals)
    except (ValueError, OSError, JournalCorruptError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2
    if argv is None:  # the command's own process (not a caller's main([...]))
        _exit_without_teardown(code)
    return code


def _exit_without_teardown(code: int) -> NoReturn:
    """End a stopped worker's process now: the interpreter's teardown with torch imported
    takes seconds (more on a busy host), which a drained worker's SIGTERM, a pod's
    termination and a restart on the same port would wait for. The server, its ports and its
    executors were released already; only logs and stdout remain to be written."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())

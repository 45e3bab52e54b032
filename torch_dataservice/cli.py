"""`torch-dataservice dispatcher|worker`: the servers as standalone processes.

Both run until SIGTERM or SIGINT, then stop cleanly (exit code 0, port released).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence

from torch_dataservice.config import DispatcherConfig, WorkerConfig
from torch_dataservice.errors import JournalCorruptError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torch-dataservice",
        description="Run a torch_dataservice dispatcher or worker until SIGTERM/SIGINT.")
    parser.add_argument("--log-level", default="INFO",
                        help="logging level: DEBUG, INFO, WARNING, ERROR (default: INFO)")
    commands = parser.add_subparsers(dest="command", required=True)

    d = commands.add_parser("dispatcher", help="run the dispatcher (control plane)")
    d.add_argument("--port", type=int, default=5000,
                   help="port to listen on; 0 picks a free one (default: 5000)")
    d.add_argument("--host", default="localhost",
                   help="address to bind and to advertise (default: localhost)")
    d.add_argument("--work-dir", default=None,
                   help="directory for the journal of dispatcher state (fault tolerance)")
    d.add_argument("--fault-tolerant", action="store_true",
                   help="journal every state change to --work-dir and replay it on start")
    d.add_argument("--journal-recovery", choices=("fail", "truncate"), default="fail",
                   help="a journal damaged in the middle: refuse to start (fail, default) or "
                        "cut it at the damage, losing the records after it (truncate)")
    d.add_argument("--worker-addresses", default=None,
                   help="comma-separated fixed worker list HOST:PORT,... (needed by static "
                        "sharding: FILE, DATA, FILE_OR_DATA, HINT)")
    d.add_argument("--worker-timeout-ms", type=int, default=None,
                   help="a worker silent this long is declared dead (default: 10000)")
    d.add_argument("--job-gc-timeout-ms", type=int, default=None,
                   help="an iteration without clients this long is collected (default: 300000)")

    w = commands.add_parser("worker", help="run a worker (runs pipelines, serves elements)")
    w.add_argument("--dispatcher", required=True, help="dispatcher address HOST:PORT")
    w.add_argument("--port", type=int, default=0,
                   help="port to listen on; 0 picks a free one (default: 0)")
    w.add_argument("--host", default="localhost",
                   help="address to bind and to advertise (default: localhost)")
    w.add_argument("--worker-address", default=None,
                   help="address the dispatcher gives clients (default: HOST:PORT)")
    w.add_argument("--processes", type=int, default=None,
                   help="executor processes that run pipelines (default: all cores)")
    w.add_argument("--heartbeat-interval-ms", type=int, default=None,
                   help="how often to heartbeat the dispatcher (default: 500)")
    w.add_argument("--cross-trainer-cache-bytes", type=int, default=1 << 30,
                   help="bytes of the cross-trainer cache window per job (default: 1 GiB)")
    w.add_argument("--split-prefetch", type=int, default=16,
                   help="most DYNAMIC splits a task keeps in stock ahead of need (default: 16)")
    w.add_argument("--executor-torch-threads", type=int, default=1,
                   help="torch threads in each executor process (default: 1, as torch's "
                        "DataLoader workers; 0 keeps torch's default)")
    return parser


def _serve(server, stop: threading.Event) -> None:
    def handle(signum, frame) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    while not stop.wait(0.2):
        if server.join(timeout=0):
            break
    server.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    try:
        if args.command == "dispatcher":
            from torch_dataservice.dispatcher.server import DispatchServer

            addresses = args.worker_addresses.split(",") if args.worker_addresses else None
            server = DispatchServer(DispatcherConfig(
                port=args.port, host=args.host, work_dir=args.work_dir,
                fault_tolerant_mode=args.fault_tolerant, worker_addresses=addresses,
                journal_recovery=args.journal_recovery,
                worker_timeout_ms=args.worker_timeout_ms,
                job_gc_timeout_ms=args.job_gc_timeout_ms))
            print(f"dispatcher serving at {server.target}", flush=True)
            _serve(server, stop)
            return 0
        from torch_dataservice.worker.server import WorkerServer

        worker = WorkerServer(WorkerConfig(
            dispatcher_address=args.dispatcher, port=args.port, host=args.host,
            worker_address=args.worker_address, num_processes=args.processes,
            heartbeat_interval_ms=args.heartbeat_interval_ms,
            cross_trainer_cache_bytes=args.cross_trainer_cache_bytes,
            split_prefetch=args.split_prefetch,
            executor_torch_threads=args.executor_torch_threads or None))
        print(f"worker serving at {worker.address}", flush=True)
        _serve(worker, stop)
        if worker.refused is not None:
            print(f"error: the dispatcher refused this worker: {worker.refused}",
                  file=sys.stderr, flush=True)
            return 2
        return 0
    except (ValueError, OSError, JournalCorruptError) as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Fuzz every dispatcher and worker RPC and the worker's data port with random and mutated
requests (seeded), then check the servers still serve an exactly-once epoch.

A server must never crash, never hang an RPC past its deadline, never leak threads or grow
memory without bound, and must answer garbage with an error status. The test suite runs a
short seeded run (tests/fault/test_fuzz.py); a longer one:

    python tests/fault/fuzz.py --cases 20000 --seed 7

prints cases per target, the statuses seen, and the RSS and thread growth.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import resource
import socket
import struct
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import descriptor as _descriptor
from google.protobuf import message_factory

import torch_dataservice as tds
from torch_dataservice.proto import dispatcher_pb2, worker_pb2
from torch_dataservice.rpc import WORKER_SERVICE_NAME
from torch_dataservice.wire import data_port as wire

RPC_DEADLINE_S = 10.0
EDGE_INTS = [0, 1, -1, 2, 7, 1000, 2000, 3000, 4000, 5000, 2**31 - 1, -2**31, 2**62,
             2**63 - 1, -2**63]
FD = _descriptor.FieldDescriptor
MAX_THREAD_GROWTH = 20  # a few pool threads start lazily; a leak per case would be thousands
MAX_RSS_GROWTH_MB = 200.0


@dataclass
class FuzzReport:
    cases: collections.Counter = field(default_factory=collections.Counter)
    statuses: collections.Counter = field(default_factory=collections.Counter)
    slow: list[str] = field(default_factory=list)  # RPCs that hit the deadline
    # INTERNAL answers other than an undecodable request: a handler that failed.
    internal: collections.Counter = field(default_factory=collections.Counter)

    def __str__(self) -> str:
        per_target = ", ".join(f"{k}={v}" for k, v in sorted(self.cases.items()))
        statuses = ", ".join(f"{k}={v}" for k, v in self.statuses.most_common())
        internal = "".join(f"\n  {v} x {k}" for k, v in self.internal.most_common(20))
        return (f"cases: {per_target}\nstatuses: {statuses}\ndeadline hits: {self.slow}\n"
                f"handler failures (INTERNAL): {sum(self.internal.values())}{internal}")


def random_message(message_type: Any, rng: random.Random, depth: int = 0) -> Any:
    """A message of `message_type` with random, often edge-case, field values."""
    message = message_type()
    for f in message.DESCRIPTOR.fields:
        if rng.random() < 0.4:
            continue
        count = rng.randint(0, 3) if f.is_repeated else 1
        for _ in range(count):
            value = _random_value(f, rng, depth)
            if value is None:
                continue
            if f.is_repeated:
                if f.message_type is not None:
                    getattr(message, f.name).add().CopyFrom(value)
                else:
                    getattr(message, f.name).append(value)
            elif f.message_type is not None:
                getattr(message, f.name).CopyFrom(value)
            else:
                setattr(message, f.name, value)
    return message


def _random_value(f: Any, rng: random.Random, depth: int) -> Any:
    if f.message_type is not None:
        if depth > 3 or f.message_type.GetOptions().map_entry:
            return None
        return random_message(message_factory.GetMessageClass(f.message_type), rng, depth + 1)
    if f.type == FD.TYPE_BOOL:
        return rng.random() < 0.5
    if f.type in (FD.TYPE_STRING,):
        return rng.choice(["", "a", "127.0.0.1:1", "x" * rng.randint(0, 300), "\u00e9"])
    if f.type == FD.TYPE_BYTES:
        return rng.randbytes(rng.randint(0, 64))
    if f.type == FD.TYPE_ENUM:
        return rng.choice([v.number for v in f.enum_type.values])
    bits = 32 if f.type in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32) else 64
    unsigned = f.type in (FD.TYPE_UINT32, FD.TYPE_UINT64, FD.TYPE_FIXED32, FD.TYPE_FIXED64)
    value = rng.choice(EDGE_INTS) if rng.random() < 0.6 else rng.randint(-10, 10_000)
    low, high = (0, 2**bits - 1) if unsigned else (-2**(bits - 1), 2**(bits - 1) - 1)
    if f.type in (FD.TYPE_DOUBLE, FD.TYPE_FLOAT):
        return float(value)
    return min(max(value, low), high)


def mutate(data: bytes, rng: random.Random) -> bytes:
    """Flip, drop, duplicate or insert bytes of a serialized message."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        choice = rng.random()
        if not buf or choice < 0.25:
            buf[rng.randint(0, len(buf)):rng.randint(0, len(buf))] = rng.randbytes(
                rng.randint(1, 8))
        elif choice < 0.6:
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
        elif choice < 0.8:
            i = rng.randrange(len(buf))
            del buf[i:i + rng.randint(1, 4)]
        else:
            i = rng.randrange(len(buf))
            buf[i:i] = buf[i:i + rng.randint(1, 8)]
    return bytes(buf)


def _payload(message_type: Any, rng: random.Random) -> bytes:
    kind = rng.random()
    if kind < 0.15:
        return rng.randbytes(rng.randint(0, 200))
    valid = random_message(message_type, rng).SerializeToString()
    return valid if kind < 0.55 else mutate(valid, rng)


def _grpc_targets(dispatcher: str, worker: str) -> list[tuple[str, str, str, Any, bool]]:
    """(name, address, full method, request type, streaming) for every RPC."""
    targets = []
    service = dispatcher_pb2.DESCRIPTOR.services_by_name["DispatcherService"]
    for method in service.methods:
        request_type = message_factory.GetMessageClass(method.input_type)
        targets.append((method.name, dispatcher, f"/{service.full_name}/{method.name}",
                        request_type, False))
    for name, request_type, streaming in (
            ("GetElements", worker_pb2.GetElementsRequest, False),
            ("StreamElements", worker_pb2.GetElementsRequest, True),
            ("ProcessTask", worker_pb2.ProcessTaskRequest, False)):
        targets.append((name, worker, f"/{WORKER_SERVICE_NAME}/{name}", request_type,
                        streaming))
    return targets


def _identity(data: bytes) -> bytes:
    return data


def fuzz_grpc(dispatcher: str, worker: str, cases: int, rng: random.Random,
              report: FuzzReport) -> None:
    channels = {a: grpc.insecure_channel(a) for a in (dispatcher, worker)}
    try:
        targets = _grpc_targets(dispatcher, worker)
        for _ in range(cases):
            name, address, method, request_type, streaming = rng.choice(targets)
            payload = _payload(request_type, rng)
            report.cases[name] += 1
            channel = channels[address]
            start = time.monotonic()
            try:
                if streaming:
                    call = channel.unary_stream(method, request_serializer=_identity,
                                                response_deserializer=_identity)
                    for _ in call(payload, timeout=RPC_DEADLINE_S):
                        pass
                else:
                    channel.unary_unary(method, request_serializer=_identity,
                                        response_deserializer=_identity)(
                        payload, timeout=RPC_DEADLINE_S)
                report.statuses["OK"] += 1
            except grpc.RpcError as error:
                code = error.code()
                report.statuses[code.name] += 1
                details = error.details() or ""
                if code == grpc.StatusCode.INTERNAL and "deserializ" not in details:
                    report.internal[f"{name}: {details[:80]}"] += 1
                if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    report.slow.append(f"{name} after {time.monotonic() - start:.1f}s")
    finally:
        for channel in channels.values():
            channel.close()


def fuzz_data_port(host: str, port: int, cases: int, rng: random.Random,
                   report: FuzzReport) -> None:
    """Garbage handshakes, then a valid handshake followed by garbage requests."""
    for _ in range(cases):
        report.cases["data_port"] += 1
        with socket.create_connection((host, port), timeout=RPC_DEADLINE_S) as sock:
            sock.settimeout(RPC_DEADLINE_S)
            if rng.random() < 0.3:
                data = rng.randbytes(rng.randint(0, 40))
            else:
                data = wire.HELLO.pack(wire.MAGIC, wire.VERSION, 0)
                body = _payload(worker_pb2.GetElementsRequest, rng)
                length = len(body) if rng.random() < 0.8 else rng.choice(
                    [0, 1, 2**20 + 1, 2**32 - 1])
                data += struct.pack("<I", length) + body
            try:
                sock.sendall(data)
                sock.shutdown(socket.SHUT_WR)  # no more: the worker must answer or close
                while sock.recv(65536):
                    pass
                report.statuses["data_port_closed"] += 1
            except TimeoutError:
                report.slow.append("data_port")
            except OSError as error:  # reset: the worker dropped the connection
                report.statuses[f"data_port_{type(error).__name__}"] += 1


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def run(cases: int, seed: int, work_dir: str) -> tuple[FuzzReport, dict[str, float]]:
    """Fuzz in-process servers with `cases` cases; afterwards read an exactly-once epoch."""
    rng = random.Random(seed)
    report = FuzzReport()
    # Fuzzed heartbeats register workers that do not exist: they are declared dead soon.
    dispatcher = tds.DispatchServer(tds.DispatcherConfig(
        host="127.0.0.1", fault_tolerant_mode=True, work_dir=work_dir,
        worker_timeout_ms=1000))
    worker = tds.WorkerServer(tds.WorkerConfig(dispatcher.address, host="127.0.0.1",
                                               num_processes=1))
    try:
        tds.register_dataset(dispatcher.target, tds.Pipeline.range(3))  # something to hit
        threads0, rss0 = threading.active_count(), rss_mb()
        fuzz_grpc(dispatcher.address, worker.address, cases, rng, report)
        data_port = worker._data_port  # noqa: SLF001 - the port under test
        if data_port is not None and data_port.port:
            fuzz_data_port("127.0.0.1", data_port.port, max(1, cases // 5), rng, report)
        time.sleep(0.5)  # connection threads end
        growth = {"threads": threading.active_count() - threads0, "rss_mb": rss_mb() - rss0}
        n = 2_000
        epoch = sorted(tds.Pipeline.range(n).apply(tds.distribute(
            "distributed_epoch", dispatcher.target, job_name="after-fuzz")))
        if epoch != list(range(n)):
            raise AssertionError(f"after fuzzing, the epoch was not exactly once: "
                                 f"{len(epoch)} elements, {len(set(epoch))} distinct")
        return report, growth
    finally:
        worker.stop()
        dispatcher.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as work_dir:
        report, growth = run(args.cases, args.seed, work_dir)
    print(report)
    print(f"growth: threads={growth['threads']} rss={growth['rss_mb']:.1f} MB; "
          f"{time.monotonic() - start:.1f}s; an exactly-once epoch afterwards: ok")
    failed = report.slow or report.internal or growth["threads"] > MAX_THREAD_GROWTH or (
        growth["rss_mb"] > MAX_RSS_GROWTH_MB)
    print("FAILED" if failed else "PASSED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

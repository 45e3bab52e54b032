"""`torch-dataservice status` output: the dispatcher's GetClusterStatus reply, for people
(aligned columns, rates with units) or for programs (`--json`)."""

from __future__ import annotations

import json
import re
import sys
import threading
from collections.abc import Sequence
from typing import TextIO

from google.protobuf import json_format

from torch_dataservice.proto import status_pb2


def as_json(reply: status_pb2.GetClusterStatusResponse) -> str:
    return json.dumps(json_format.MessageToDict(
        reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True),
        indent=2, sort_keys=True)


def as_text(reply: status_pb2.GetClusterStatusResponse, dispatcher: str) -> str:
    load = reply.load
    lines = [f"dispatcher {dispatcher}   version {reply.version} (protocol {reply.protocol})"
             f"   up {duration(reply.uptime_s)}",
             f"load {load.cores:.2f} cores, {rate(load.rpcs_per_s)} RPC/s answered, "
             f"{rate(load.refused_per_s)}/s refused (over capacity)   heartbeat intervals: "
             f"workers {_interval(load.worker_heartbeat_ms)}, readers "
             f"{_interval(load.client_heartbeat_ms)}", ""]
    lines += _section(f"WORKERS ({len(reply.workers)})", (
        "ADDRESS", "STATE", "HEARTBEAT", "TASKS", "ELEMENTS/S", "BYTES/S", "SENT",
        "BUFFERED", "CAPACITY/S", "CACHE", "HELD SPLITS"), [
        (w.address, w.state, f"{w.heartbeat_age_s:.1f}s ago", str(w.tasks),
         rate(w.elements_per_s), size(w.bytes_per_s) + "/s", count(w.elements_sent),
         count(w.buffered_elements), rate(w.capacity_per_s) if w.capacity_per_s else "-",
         _cache(w), count(w.held_splits) if w.held_splits else "-")
        for w in reply.workers])
    lines += _section(f"ITERATIONS ({len(reply.iterations)})", (
        "ID", "DATASET", "JOB", "MODE", "CLIENTS", "TASKS", "SPLITS DONE/HANDED",
        "DELIVERED", "OPTIMAL WORKERS", "STATE"), [
        (str(i.iteration_id), i.dataset_id, i.job_name or "-",
         i.mode + (f" x{i.num_consumers}" if i.num_consumers else ""), str(i.clients),
         str(i.tasks), f"{i.splits_done}/{i.splits_handed}" if i.splits_handed else "-",
         count(i.elements_delivered), str(i.optimal_workers or "-"),
         "finished" if i.finished else "running")
        for i in reply.iterations])
    lines += _section(f"CLIENTS ({len(reply.clients)})", (
        "ID", "ITERATION", "RANK", "BATCHES", "BATCHES/S", "WAIT/BATCH", "WAITING",
        "HEARTBEAT"), [
        (str(c.client_id), str(c.iteration_id), str(c.rank), count(c.batches),
         rate(c.batches_per_s), seconds(c.wait_per_batch_s), f"{100 * c.wait_fraction:.0f}%",
         f"{c.heartbeat_age_s:.1f}s ago")
        for c in reply.clients])
    return "\n".join(lines).rstrip() + "\n"


def _cache(worker: status_pb2.WorkerStatus) -> str:
    """Its cache() entries' size and hit rate, e.g. `1.2 GB 97% hits`; `-` without one."""
    looked_up = worker.cache_hits + worker.cache_misses
    if not looked_up and not worker.cache_bytes:
        return "-"
    hits = f" {100 * worker.cache_hits / looked_up:.0f}% hits" if looked_up else ""
    evicted = f" {count(worker.cache_evictions)} evicted" if worker.cache_evictions else ""
    return size(worker.cache_bytes) + hits + evicted


def _interval(ms: int) -> str:
    """An interval in force (0: the peers' own defaults, the fleet is small)."""
    return f"{ms / 1000:g}s" if ms else "default"


def _section(title: str, header: Sequence[str], rows: list[Sequence[str]]) -> list[str]:
    if not rows:
        return [f"{title}: none", ""]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    numeric = [all(_is_number(row[i]) for row in rows) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        cells = [cell.rjust(w) if right else cell.ljust(w)
                 for cell, w, right in zip(row, widths, numeric, strict=True)]
        return "  ".join(cells).rstrip()

    return [title, line(header), *(line(row) for row in rows), ""]


_NUMBER = re.compile(r"-|[\d,.]+(%| ?[a-zA-Z]+(/s)?|/s|/[\d,]+|s ago)?")


def _is_number(cell: str) -> bool:
    """A count, rate, size or duration (right-aligned), not an address or a name."""
    return _NUMBER.fullmatch(cell) is not None


def count(n: float) -> str:
    return f"{int(n):,}"


def rate(per_s: float) -> str:
    return f"{per_s:,.1f}/s" if per_s < 100 else f"{per_s:,.0f}/s"


def size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def seconds(s: float) -> str:
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def duration(s: float) -> str:
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def fetch_status(dispatcher: str, timeout_s: float = 5.0
                 ) -> status_pb2.GetClusterStatusResponse:
    """One GetClusterStatus call to `dispatcher` (HOST:PORT or grpc://HOST:PORT)."""
    from torch_dataservice.proto import dispatcher_pb2_grpc
    from torch_dataservice.rpc import channel_to, parse_service

    _, address = parse_service(dispatcher)
    stub = dispatcher_pb2_grpc.DispatcherServiceStub(channel_to(address))
    return stub.GetClusterStatus(status_pb2.GetClusterStatusRequest(), timeout=timeout_s)


def show_status(dispatcher: str, json_output: bool, watch_s: float | None,
                out: TextIO, stop: threading.Event) -> int:
    """`torch-dataservice status`: print once, or every `watch_s` seconds until `stop`."""
    import grpc

    if watch_s is not None and not watch_s > 0:
        raise ValueError(f"--watch must be a positive number of seconds, got {watch_s!r}")
    while True:
        try:
            reply = fetch_status(dispatcher)
        except grpc.RpcError as error:
            print(f"error: dispatcher {dispatcher} did not answer: {error.code().name} "
                  f"({error.details()})", file=sys.stderr, flush=True)
            if watch_s is None:
                return 2
        else:
            if watch_s is not None and not json_output and out.isatty():
                out.write("\033[H\033[2J")  # redraw in place, like `watch`
            out.write(as_json(reply) + "\n" if json_output else as_text(reply, dispatcher))
            out.flush()
        if watch_s is None or stop.wait(watch_s):
            return 0

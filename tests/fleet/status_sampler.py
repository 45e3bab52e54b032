"""Samples a dispatcher from a fleet host (the test process is outside the fleet's network):
its status every PERIOD seconds, and its Prometheus metrics every second, as JSON lines in
OUT, until the file STOP exists (or MAX_S seconds passed). It prints "sampling" once the first
status came back.

A status line: {"t": unix time, "load": {...}, "ages": {client id: heartbeat age s},
"iterations": [{"id", "clients", "splits_handed", "finished"}], "workers": count}; a metrics
line: {"t": ..., "metrics": {name or name{labels}: value}} of the tds_dispatcher_* gauges.

    python -m tests.fleet.status_sampler ADDRESS METRICS_URL PERIOD OUT STOP [MAX_S]
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.request

from torch_dataservice.proto import dispatcher_pb2_grpc, status_pb2
from torch_dataservice.rpc import channel_to

GAUGE = re.compile(r"^(tds_dispatcher_\w+(?:\{[^}]*\})?) (\S+)$", re.M)


def status_line(reply: status_pb2.GetClusterStatusResponse) -> dict:
    load = reply.load
    return {"t": time.time(), "workers": len(reply.workers),
            "load": {"cores": load.cores, "rpcs_per_s": load.rpcs_per_s,
                     "refused_per_s": load.refused_per_s,
                     "worker_heartbeat_ms": load.worker_heartbeat_ms,
                     "client_heartbeat_ms": load.client_heartbeat_ms, "stretch": load.stretch},
            "ages": {str(c.client_id): c.heartbeat_age_s for c in reply.clients},
            "iterations": [{"id": it.iteration_id, "clients": it.clients,
                            "splits_handed": it.splits_handed, "finished": it.finished}
                           for it in reply.iterations]}


def main() -> int:
    address, metrics_url, period, out, stop = sys.argv[1:6]
    max_s = float(sys.argv[6]) if len(sys.argv) > 6 else 300.0
    stub = dispatcher_pb2_grpc.DispatcherServiceStub(channel_to(address))
    began = time.monotonic()
    scraped = 0.0
    with open(out, "w") as sink:
        while not os.path.exists(stop) and time.monotonic() - began < max_s:
            due = time.monotonic() + float(period)
            reply = stub.GetClusterStatus(status_pb2.GetClusterStatusRequest(), timeout=10)
            sink.write(json.dumps(status_line(reply)) + "\n")
            if not scraped:
                print("sampling", flush=True)
            if time.monotonic() - scraped >= 1.0:
                scraped = time.monotonic()
                text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
                sink.write(json.dumps({"t": time.time(), "metrics": {
                    m.group(1): float(m.group(2)) for m in GAUGE.finditer(text)}}) + "\n")
            sink.flush()
            time.sleep(max(0.0, due - time.monotonic()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

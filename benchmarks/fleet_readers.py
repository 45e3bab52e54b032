"""The dispatcher under real readers, beside the simulation's prediction for the same size.

On the network-namespace fleet (tests/fleet/hosts.py; needs root and iproute2), a journaled
dispatcher, 4 worker hosts and 8 trainer processes of 8 reader threads (64 real readers, as
many as the machine's memory allows) read one DYNAMIC epoch of unique ids under one job name
(tests/fleet/many_readers.py). Over the window in which all 64 readers are attached we
measure the dispatcher's CPU (/proc/PID/stat), the RPC/s and load it reports (status and
metrics), the heartbeat intervals it announces, and the interval each reader really used,
counted at the dispatcher (its status is polled every --period seconds, faster than the
readers beat: those polls are RPCs the dispatcher answers too, counted in its RPC/s). The
epoch must be read exactly once.

Then, on the same machine, `benchmarks/dispatcher_capacity.py --workers 4 --clients 64`
simulates that fleet (its workers asking for splits at the rate the real ones did) and the
two are printed side by side, with ratios (fleet / simulation).

    sudo python benchmarks/fleet_readers.py                   # about 2 minutes
    sudo python benchmarks/fleet_readers.py --json benchmarks/results/fleet_readers.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

from _common import HERE, child_env  # first: puts this checkout on the import path

from tests.fault.helpers import tally_all
from tests.fleet.hosts import Fleet
from tests.fleet.many_readers import HOSTS, WORKER_HOSTS, measure, run_readers


def simulate(mode: str, readers: int, split_rate: float, seconds: float) -> dict:
    """dispatcher_capacity.py's row for 4 workers + `readers` clients in `mode`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "capacity.json")
        subprocess.run(
            [sys.executable, os.path.join(HERE, "dispatcher_capacity.py"), "--workers",
             str(len(WORKER_HOSTS)), "--clients", str(readers), "--modes", mode,
             "--split-rate", f"{split_rate:.4g}", "--seconds", str(seconds), "--json", out],
            check=True, env=child_env(), stdout=subprocess.DEVNULL, timeout=600)
        with open(out) as f:
            return json.load(f)["rows"][0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=8, help="trainer processes")
    parser.add_argument("--threads", type=int, default=8, help="reader threads per process")
    parser.add_argument("--rate", type=float, default=30.0,
                        help="elements/s per reader (the epoch lasts about --seconds)")
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="how long the epoch lasts at --rate; also the simulated window")
    parser.add_argument("--period", type=float, default=0.05,
                        help="seconds between status polls (faster than the readers beat)")
    parser.add_argument("--budget", type=int, default=None,
                        help="the dispatcher's --heartbeat-budget-rps (default: its own)")
    parser.add_argument("--mode", default="journal", choices=("journal", "memory"),
                        help="the simulated dispatcher (the fleet's is journaled)")
    parser.add_argument("--json", default=None, help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    readers = args.processes * args.threads
    n = int(readers * args.rate * args.seconds)

    fleet = Fleet(HOSTS)
    began = time.perf_counter()
    try:
        fleet.start()
        run = run_readers(fleet, n, args.processes, args.threads, args.rate, args.budget,
                          args.period, timeout_s=max(120.0, 6 * args.seconds))
        tally = tally_all(run.outs, n)  # before close() removes the shared directory
    finally:
        fleet.close()
    load_fleet = os.getloadavg()
    figures = measure(run)
    ratios = figures.reader_ratios
    used_ms = statistics.median(ratios) * figures.client_interval_ms if ratios else float("nan")
    split_rate = max(0.01, figures.splits_per_s / len(WORKER_HOSTS))
    sim = simulate(args.mode, readers, split_rate, args.seconds / 2)
    load_sim = os.getloadavg()

    rows = [  # (what, fleet, simulation)
        ("dispatcher cores", figures.cores, sim["cores"]),
        ("RPCs answered/s", figures.rpcs_per_s, sim["achieved_rps"]),
        ("  less the status polls", figures.rpcs_per_s - figures.status_polls_per_s,
         sim["achieved_rps"]),
        # What the intervals in force predict: every reader and worker beating as announced,
        # plus the splits and the status polls.
        ("  predicted at those intervals", readers / figures.client_interval_ms * 1000
         + len(WORKER_HOSTS) / figures.worker_interval_ms * 1000 + figures.splits_per_s
         + figures.status_polls_per_s, sim["achieved_rps"]),
        ("CPU ms per RPC", 1000 * figures.cores / figures.rpcs_per_s,
         1000 * sim["cores"] / sim["achieved_rps"]),
        ("refused/s", figures.refused_per_s, sim["refused_rps"]),
        ("reader interval announced ms", figures.client_interval_ms, sim["client_interval_ms"]),
        ("reader interval used ms", used_ms, sim["client_interval_ms"]),
        ("worker interval announced ms", figures.worker_interval_ms, sim["worker_interval_ms"]),
        ("splits/s", figures.splits_per_s, sim["split_rps"]),
        ("dispatcher RSS MB", run.dispatcher_rss_mb, sim["rss_mb"]),
    ]
    print(f"{os.cpu_count()} cores; load average {load_fleet[0]:.1f} after the fleet run, "
          f"{load_sim[0]:.1f} after the simulation; {readers} readers "
          f"({args.processes} processes x {args.threads} threads) + {len(WORKER_HOSTS)} "
          f"workers, one DYNAMIC job of {n} ids at {args.rate:g}/s per reader; fleet window "
          f"{figures.window_s:.1f} s (all readers attached), read in {run.seconds:.1f} s, "
          f"{time.perf_counter() - began:.0f} s in all")
    print(f"exactly once: {tally}; readers' peak RSS {sum(run.reader_rss_mb):.0f} MB in all "
          f"({max(run.reader_rss_mb, default=0):.0f} MB per process), workers "
          f"{run.worker_rss_mb:.0f} MB with their executors")
    print(f"cadence predicts readers {figures.predicted_client_ms:.0f} ms, workers "
          f"{figures.predicted_worker_ms:.0f} ms for this population; the dispatcher stretched "
          f"up to x{figures.stretch:.1f}; readers' used/announced interval per reader: median "
          f"{statistics.median(ratios) if ratios else float('nan'):.2f}, "
          f"{min(ratios, default=float('nan')):.2f}..{max(ratios, default=float('nan')):.2f} "
          f"({len(ratios)} readers)")
    print(f"{'':<32} {'fleet':>9} {'sim ' + args.mode:>12} {'ratio':>6}")
    for what, real, simulated in rows:
        ratio = real / simulated if simulated else float("nan")
        print(f"{what:<32} {real:>9.2f} {simulated:>12.2f} {ratio:>6.2f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "fleet_readers", "cores": os.cpu_count(),
                       "load_average": [load_fleet[0], load_sim[0]], "readers": readers,
                       "workers": len(WORKER_HOSTS), "elements": n, "rate": args.rate,
                       "exactly_once": tally.missing == tally.duplicated == 0 and tally.done,
                       "fleet": asdict(figures), "simulation": sim,
                       "reader_rss_mb": run.reader_rss_mb, "worker_rss_mb": run.worker_rss_mb,
                       "rows": [{"what": w, "fleet": r, "simulation": s} for w, r, s in rows]},
                      f, indent=1)
        print(f"wrote {args.json}")
    return 0 if tally.missing == tally.duplicated == 0 and tally.done else 1


if __name__ == "__main__":
    sys.exit(main())

"""How fast a worker starts and how heavy its executors are, beside a same-run baseline.

Every measurement runs in a fresh interpreter, as a user's script would, in `--rounds`
interleaved rounds (medians and minima are printed; machines are shared and noisy):

  import        `python -c` importing torch and the servers' modules: what any script pays
                before its first server starts (the baseline of the rows below)
  quickstart    examples/quickstart.py's dispatcher, two workers (1 executor each) and
                pipeline, timed inside: the servers' start() calls, the first element after
                them, the last element
  quickstart.py `python examples/quickstart.py` end to end
  readme        the README's first snippet (default processes = all cores), as a script,
                end to end
  memory        a worker with 2 executors that ran a torch map: each executor's RSS, PSS and
                USS (private pages) from /proc/PID/smaps_rollup

    python benchmarks/startup.py                  # 5 rounds, about a minute or two
    python benchmarks/startup.py --rounds 3 --only quickstart --only import

`TORCH_DATASERVICE_EXECUTOR_START=interpreter` in the environment starts executors as fresh
interpreters (the fallback) instead of forking them from the preloaded fork server.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.py"
CASES = ("import", "quickstart", "quickstart.py", "readme", "memory")

IMPORT_BASELINE = "import torch\nimport torch_dataservice.worker.server\n"

# Runs in a child: the quickstart's own function and pipeline, timed around the servers.
QUICKSTART_CHILD = """
import json, runpy, sys, time
began = time.perf_counter()
import torch_dataservice as tds
quickstart = runpy.run_path(sys.argv[1], run_name="quickstart")  # defs only: no __main__
imported = time.perf_counter()
dispatcher = tds.DispatchServer(tds.DispatcherConfig(port=0))
workers = [tds.WorkerServer(tds.WorkerConfig(dispatcher.address, num_processes=1))
           for _ in range(2)]
started = time.perf_counter()
pipeline = tds.Pipeline.range(quickstart["NUM_ELEMENTS"]).map(quickstart["make_example"]).batch(
    quickstart["BATCH_SIZE"]).apply(tds.distribute("distributed_epoch", dispatcher.target))
batches = iter(pipeline)
next(batches)
first = time.perf_counter()
count = 1 + sum(1 for _ in batches)
last = time.perf_counter()
for worker in workers:
    worker.stop()
dispatcher.stop()
print(json.dumps({"imports_s": imported - began, "start_s": started - imported,
                  "first_after_start_s": first - started, "first_s": first - imported,
                  "last_s": last - imported, "batches": count}))
"""

MEMORY_CHILD = """
import json, os
import torch
import torch_dataservice as tds

def work(i):
    return (torch.arange(1000, dtype=torch.float32) * i).sum().item()

def rollup(pid):
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[-1] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) / 1024
    return {"rss": fields["Rss"], "pss": fields["Pss"],
            "uss": fields["Private_Clean"] + fields["Private_Dirty"]}

dispatcher = tds.DispatchServer(tds.DispatcherConfig(port=0))
worker = tds.WorkerServer(tds.WorkerConfig(dispatcher.address, num_processes=2))
data = tds.Pipeline.range(200).map(work).apply(tds.distribute("parallel_epochs",
                                                              dispatcher.target))
assert len(list(data)) == 200
pids = [slot.process.pid for slot in worker._tasks._executors._slots]
executors = [rollup(pid) for pid in pids]
ppids = set()
for pid in pids:
    with open(f"/proc/{pid}/stat") as f:
        ppids.add(int(f.read().rsplit(")", 1)[1].split()[1]))
servers = [rollup(p) for p in ppids if p != os.getpid()]
worker.stop()
dispatcher.stop()
print(json.dumps({"executors": executors, "fork_server": servers}))
"""


def readme_snippet() -> str:
    """The README's first python block, as a user would paste it into a script."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"```python\n(.*?)```", text, re.S)
    if match is None:
        raise SystemExit("no python block in README.md")
    return match.group(1)


def run(args: list[str], env: dict[str, str], timeout: float = 300) -> tuple[float, str]:
    """Wall seconds of a child interpreter, and its stdout (it must succeed)."""
    began = time.perf_counter()
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                            timeout=timeout, cwd=ROOT)
    wall = time.perf_counter() - began
    if result.returncode != 0:
        raise SystemExit(f"{args[:2]} failed:\n{result.stderr[-3000:]}")
    return wall, result.stdout


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):6.2f}  min {min(values):6.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=CASES, action="append",
                        help="run only these cases (repeatable)")
    parser.add_argument("--json", help="write every measurement to this file")
    args = parser.parse_args(argv)
    cases = args.only or list(CASES)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    results: dict[str, list] = {case: [] for case in cases}
    with tempfile.TemporaryDirectory() as tmp:
        readme = Path(tmp) / "readme_snippet.py"
        readme.write_text(readme_snippet())
        for round_ in range(args.rounds):
            for case in cases:
                if case == "import":
                    results[case].append(run(["-c", IMPORT_BASELINE], env)[0])
                elif case == "quickstart":
                    results[case].append(json.loads(
                        run(["-c", QUICKSTART_CHILD, str(QUICKSTART)], env)[1]))
                elif case == "quickstart.py":
                    results[case].append(run([str(QUICKSTART)], env)[0])
                elif case == "readme":
                    results[case].append(run([str(readme)], env)[0])
                elif case == "memory":
                    results[case].append(json.loads(run(["-c", MEMORY_CHILD], env)[1]))
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    method = os.environ.get("TORCH_DATASERVICE_EXECUTOR_START", "default")
    print(f"executor start: {method}; {args.rounds} rounds; seconds unless noted")
    base = statistics.median(results["import"]) if "import" in results else None

    def ratio(values: list[float]) -> str:
        return f"  = {statistics.median(values) / base:4.2f}x import" if base else ""

    if "import" in results:
        print(f"import (baseline)              {summary(results['import'])}")
    if "quickstart" in results:
        rows = results["quickstart"]
        for key, label in (("start_s", "quickstart: servers' start()"),
                           ("first_after_start_s", "quickstart: 1st element after"),
                           ("first_s", "quickstart: 1st element from"),
                           ("last_s", "quickstart: last element from")):
            values = [row[key] for row in rows]
            print(f"{label:30s} {summary(values)}{ratio(values)}")
    for case in ("quickstart.py", "readme"):
        if case in results:
            label = f"{case} end to end"
            print(f"{label:30s} {summary(results[case])}{ratio(results[case])}")
    if "quickstart.py" in results and "readme" in results:
        both = statistics.median(results["readme"]) / statistics.median(results["quickstart.py"])
        print(f"readme / quickstart.py         {both:.2f}x")
    if "memory" in results:
        for kind in ("rss", "pss", "uss"):
            values = [e[kind] for row in results["memory"] for e in row["executors"]]
            print(f"executor {kind.upper()} MiB               {summary(values)}")
        for kind in ("rss", "uss"):
            servers = [s[kind] for row in results["memory"] for s in row["fork_server"]]
            if servers:
                print(f"fork server {kind.upper()} MiB            {summary(servers)}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

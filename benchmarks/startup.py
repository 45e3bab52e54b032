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
  embedded      a training script's first batch from `tds.DataLoader(num_workers=2)` with no
                service given (it starts its own), from the loader's construction; beside
                torch's DataLoader (2 forked workers) in the same child, run first

    python benchmarks/startup.py                  # 5 rounds, a few minutes
    python benchmarks/startup.py --rounds 3 --only quickstart --only import
    git archive HEAD~3 | tar -x -C /tmp/before    # an earlier commit, beside this one:
    python benchmarks/startup.py --against /tmp/before

`--interpreter` adds the same cases with `TORCH_DATASERVICE_EXECUTOR_START=interpreter`
(executors as fresh interpreters, the fallback, instead of forks of the preloaded fork server).
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
START_ENV = "TORCH_DATASERVICE_EXECUTOR_START"
CASES = ("import", "quickstart", "quickstart.py", "readme", "memory", "embedded")

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

EMBEDDED_CHILD = """
import json, os, time
import torch
import torch_dataservice as tds

class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return torch.full((3,), float(i * i))

def first_batch(loader_type):
    began = time.perf_counter()
    batches = iter(loader_type(Squares(), batch_size=8, num_workers=2))
    next(batches)
    return time.perf_counter() - began

torch_s = first_batch(torch.utils.data.DataLoader)
tds_s = first_batch(tds.DataLoader)
print(json.dumps({"torch_first_s": torch_s, "tds_first_s": tds_s}))
os._exit(0)  # skip the embedded service's exit hooks: not part of the figure
"""


def readme_snippet() -> str:
    """The README's first python block, as a user would paste it into a script."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"```python\n(.*?)```", text, re.S)
    if match is None:
        raise SystemExit("no python block in README.md")
    return match.group(1)


def run(args: list[str], env: dict[str, str], timeout: float = 120) -> tuple[float, str]:
    """Wall seconds of a child interpreter, and its stdout (it must succeed). It runs in a
    neutral directory: `python -c` would import the package from its working directory first."""
    began = time.perf_counter()
    try:
        result = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                                env=env, timeout=timeout, cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired as error:  # counted and reported, not fatal
        stderr = error.stderr.decode(errors="replace") if error.stderr else ""
        print(f"TIMEOUT after {timeout:.0f}s: {args[:1]} with {env['PYTHONPATH']}\n"
              f"{stderr[-1500:]}", file=sys.stderr, flush=True)
        raise
    wall = time.perf_counter() - began
    if result.returncode != 0:
        raise SystemExit(f"{args[:2]} failed:\n{result.stderr[-3000:]}")
    return wall, result.stdout


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):6.2f}  min {min(values):6.2f}"


def _measure(case: str, env: dict[str, str], readme: Path) -> object:
    if case == "import":
        return run(["-c", IMPORT_BASELINE], env)[0]
    if case == "quickstart":
        return json.loads(run(["-c", QUICKSTART_CHILD, str(QUICKSTART)], env)[1])
    if case == "quickstart.py":
        return run([str(QUICKSTART)], env)[0]
    if case == "readme":
        return run([str(readme)], env)[0]
    if case == "embedded":
        return json.loads(run(["-c", EMBEDDED_CHILD], env)[1])
    return json.loads(run(["-c", MEMORY_CHILD], env)[1])


def _figures(results: dict[str, list]) -> dict[str, list[float]]:
    """Each printed figure's measurements, by label."""
    figures: dict[str, list[float]] = {}
    if "quickstart" in results:
        for key, label in (("start_s", "quickstart: servers' start()"),
                           ("first_after_start_s", "quickstart: 1st element after"),
                           ("first_s", "quickstart: 1st element from"),
                           ("last_s", "quickstart: last element from")):
            figures[label] = [row[key] for row in results["quickstart"]]
    if "embedded" in results:
        for key, label in (("tds_first_s", "embedded: tds 1st batch"),
                           ("torch_first_s", "embedded: torch's 1st batch")):
            figures[label] = [row[key] for row in results["embedded"]]
    for case in ("quickstart.py", "readme"):
        if case in results:
            figures[f"{case} end to end"] = results[case]
    if "memory" in results:
        for kind in ("rss", "pss", "uss"):
            figures[f"executor {kind.upper()} MiB"] = [
                e[kind] for row in results["memory"] for e in row["executors"]]
        for kind in ("rss", "uss"):
            servers = [s[kind] for row in results["memory"] for s in row["fork_server"]]
            if servers:
                figures[f"fork server {kind.upper()} MiB"] = servers
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--only", choices=CASES, action="append",
                        help="run only these cases (repeatable)")
    parser.add_argument("--against", metavar="DIR",
                        help="also run every case with the package from DIR (e.g. `git archive` "
                             "of an earlier commit), interleaved round by round")
    parser.add_argument("--interpreter", action="store_true",
                        help=f"also run every case with {START_ENV}=interpreter")
    parser.add_argument("--json", help="write every measurement to this file")
    args = parser.parse_args(argv)
    cases = args.only or list(CASES)

    def environment(tree: Path, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != START_ENV}
        env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
        return {**env, **extra}

    variants = {"this": environment(ROOT, **({START_ENV: os.environ[START_ENV]}
                                             if START_ENV in os.environ else {}))}
    if args.against:
        variants["against"] = environment(Path(args.against).resolve())
    if args.interpreter:
        variants["interpreter"] = environment(ROOT, **{START_ENV: "interpreter"})
    results: dict[str, dict[str, list]] = {
        name: {case: [] for case in cases if case != "import"} for name in variants}
    imports: list[float] = []
    timeouts: dict[str, dict[str, int]] = {name: {} for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        readme = Path(tmp) / "readme_snippet.py"
        readme.write_text(readme_snippet())
        for round_ in range(args.rounds):
            for case in cases:
                if case == "import":
                    imports.append(run(["-c", IMPORT_BASELINE], variants["this"])[0])
                    continue
                for name, env in variants.items():
                    try:
                        results[name][case].append(_measure(case, env, readme))
                    except subprocess.TimeoutExpired:
                        timeouts[name][case] = timeouts[name].get(case, 0) + 1
            print(f"round {round_ + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    base = statistics.median(imports) if imports else None
    print(f"{args.rounds} rounds, interleaved; seconds unless noted; median and min")
    if base:
        print(f"{'import (baseline)':30s} {summary(imports)}")
    tables = {name: _figures(variant) for name, variant in results.items()}
    for name, figures in tables.items():
        print(f"--- {name}: {variants[name]['PYTHONPATH'].split(os.pathsep)[0]} "
              f"({variants[name].get(START_ENV, 'default start')})")
        for label, values in figures.items():
            versus = (f"  = {statistics.median(values) / base:4.2f}x import"
                      if base and "MiB" not in label else "")
            print(f"{label:30s} {summary(values)}{versus}")
        if timeouts[name]:
            print(f"{'TIMED OUT (not counted)':30s} {timeouts[name]}")
        if "quickstart.py end to end" in figures and "readme end to end" in figures:
            both = (statistics.median(figures["readme end to end"])
                    / statistics.median(figures["quickstart.py end to end"]))
            print(f"{'readme / quickstart.py':30s} {both:.2f}x")
    for name in list(tables)[1:]:
        print(f"--- this / {name} (medians)")
        for label, values in tables["this"].items():
            if tables[name].get(label):
                other = statistics.median(tables[name][label])
                print(f"{label:30s} {statistics.median(values) / other:6.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"import": imports, **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

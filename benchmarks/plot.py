r"""Draw the scaling and dispatcher-capacity curves from the JSON the benchmarks write.

    python benchmarks/scaling.py --quick --json benchmarks/results/scaling.json
    python benchmarks/dispatcher_capacity.py --quick \
        --json benchmarks/results/dispatcher_capacity.json
    python benchmarks/plot.py --scaling benchmarks/results/scaling.json \
        --capacity benchmarks/results/dispatcher_capacity.json --out docs/scaling.png

Needs matplotlib (`pip install torch-dataservice[plot]`). Left: elements/s against the number
of workers for each consumer count, with linear (N x the same run's 1-worker rate) dashed.
Middle and right: the dispatcher's CPU (cores) and GetSplit p50/p99 latency against the
simulated fleet (workers + readers), one line per mode and series (and per file when several
are given, named after the file: `dispatcher_capacity_before.json` is "before"), the budget
dotted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def load(paths: list[str]) -> list[dict]:
    documents = []
    for path in paths:
        with open(path) as f:
            documents.append(json.load(f))
    return documents


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scaling", default=None, help="JSON of benchmarks/scaling.py")
    parser.add_argument("--capacity", action="append", default=[],
                        help="JSON of benchmarks/dispatcher_capacity.py (repeatable)")
    parser.add_argument("--out", default="docs/scaling.png", help="PNG to write")
    args = parser.parse_args(argv)
    if not args.scaling and not args.capacity:
        parser.error("give --scaling and/or --capacity")
    try:
        import matplotlib
    except ImportError:
        print("benchmarks/plot.py needs matplotlib: pip install 'torch-dataservice[plot]'",
              file=sys.stderr)
        return 2
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (1 if args.scaling else 0) + (2 if args.capacity else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2), squeeze=False)
    axes = list(axes[0])
    if args.scaling:
        ax = axes.pop(0)
        (doc,) = load([args.scaling])
        rows = [r for r in doc["rows"] if not r.get("note")]
        for k, consumers in enumerate(sorted({r["consumers"] for r in rows})):
            mine = sorted((r for r in rows if r["consumers"] == consumers),
                          key=lambda r: r["workers"])
            xs = [r["workers"] for r in mine]
            line, = ax.plot(xs, [r["rate"] for r in mine], "o-",
                            label=f"{consumers} consumer{'s' if consumers > 1 else ''}")
            ax.plot(xs, [r["linear"] for r in mine], "--", color=line.get_color(), alpha=0.5,
                    label=f"linear ({consumers}c)")
            for r in mine:
                ax.annotate(f"{r['ratio']:.2f}x", (r["workers"], r["rate"]),
                            textcoords="offset points", xytext=(4, 6 if k == 0 else -12),
                            fontsize=7, color=line.get_color())
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sorted({r["workers"] for r in rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("single-process workers")
        ax.set_ylabel(f"elements/s (map sleeps {doc['sleep_ms']:g} ms)")
        ax.set_title(f"Fleet scaling, DYNAMIC, {doc['cores']} cores", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    if args.capacity:
        cpu_ax, latency_ax = axes
        budget = None
        for path, doc in zip(args.capacity, load(args.capacity), strict=True):
            budget = doc.get("budget_cores", 0.5)
            # Several files (before/after): each line is named by its file.
            run = (os.path.basename(path).removesuffix(".json").removeprefix(
                "dispatcher_capacity_") + ": ") if len(args.capacity) > 1 else ""
            keys = dict.fromkeys((r["mode"], r.get("series", "both")) for r in doc["rows"])
            for mode, series in keys:
                mine = sorted((r for r in doc["rows"]
                               if (r["mode"], r.get("series", "both")) == (mode, series)),
                              key=lambda r: r["workers"] + r["clients"])
                xs = [r["workers"] + r["clients"] for r in mine]
                label = f"{run}{mode}" + (f", {series}" if "series" in mine[0] else "")
                line, = cpu_ax.plot(xs, [r["cores"] for r in mine], "o-", label=label)
                latency_ax.plot(xs, [r["split_p50_ms"] for r in mine], "o-",
                                color=line.get_color(), label=f"{label} p50")
                latency_ax.plot(xs, [r["split_p99_ms"] for r in mine], "x:",
                                color=line.get_color(), label=f"{label} p99")
        cpu_ax.axhline(budget, color="grey", linestyle=":", label=f"budget {budget} core")
        cpu_ax.set_xlabel("simulated workers + readers")
        cpu_ax.set_ylabel("dispatcher CPU (cores)")
        cpu_ax.set_title("Dispatcher CPU", fontsize=10)
        latency_ax.set_xlabel("simulated workers + readers")
        latency_ax.set_ylabel("GetSplit latency (ms)")
        latency_ax.set_yscale("log")
        latency_ax.set_title("GetSplit latency", fontsize=10)
        for ax in (cpu_ax, latency_ax):
            ax.set_xscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

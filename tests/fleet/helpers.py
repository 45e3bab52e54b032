"""Shared by the fleet test modules: a worker's metrics scraped across the network, the
torchrun trainer on host D and the checks of what its ranks received."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from tests.fleet.hosts import Fleet, Host

HERE = Path(__file__).resolve().parent
METRICS_PORT = 9100
SAMPLES = 400  # per epoch, read by tests/fleet/trainer.py


def metrics(fleet: Fleet, host: Host, port: int = METRICS_PORT) -> dict[str, float]:
    """The worker's `tds_worker_bytes_sent_total` by transport, and `elements` (its
    `tds_worker_elements_total`), scraped from host D: across the network, as Prometheus."""
    scrape = fleet["d"].python(
        "import sys, urllib.request\n"
        "print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())",
        f"http://{host.address}:{port}/metrics", timeout_s=30)
    assert scrape.returncode == 0, scrape.stderr
    figures = {m.group(1): float(m.group(2)) for m in re.finditer(
        r'^tds_worker_bytes_sent_total\{transport="(\w+)"\} (\S+)$', scrape.stdout, re.M)}
    (elements,) = re.findall(r"^tds_worker_elements_total (\S+)$", scrape.stdout, re.M)
    return {**figures, "elements": float(elements)}


def torchrun(fleet: Fleet, target: str, out: Path, env: dict[str, str],
             *extra: str) -> None:
    """tests/fleet/trainer.py under torchrun on host D, two ranks (gloo, CPU)."""
    result = fleet["d"].run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         str(HERE / "trainer.py"), target, str(out), "--samples", str(SAMPLES), *extra],
        timeout_s=90, env=env)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"


def ranks(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def assert_exactly_once(parts: list[list[int]], n: int) -> None:
    """The ranks' parts are disjoint, cover range(n), and each rank got some."""
    together = [i for part in parts for i in part]
    assert sorted(together) == list(range(n)), (
        f"{len(together)} elements, {len(set(together))} distinct, of {n}")
    assert all(parts), [len(p) for p in parts]

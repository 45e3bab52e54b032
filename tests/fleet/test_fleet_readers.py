"""64 real readers (8 trainer processes of 8 reader threads, on 4 trainer hosts) share one
DYNAMIC job served by 4 worker hosts and a journaled dispatcher (tests/fleet/many_readers.py):
the epoch is read exactly once, and the readers heartbeat at the interval the dispatcher
announced, as it saw them. A small heartbeat budget makes the dispatcher stretch the readers'
interval about fivefold (cadence.py), so a reader that kept its own 100 ms would show.

No wall-clock figure of the product's speed is asserted: counts, and ratios with generous
bounds. benchmarks/fleet_readers.py runs the same fleet at the default budget and sets its
figures beside the simulation's (benchmarks/dispatcher_capacity.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator

import pytest

from tests.fault.helpers import tally_all
from tests.fleet.conftest import started_fleet
from tests.fleet.hosts import Fleet
from tests.fleet.many_readers import HOSTS, measure, run_readers

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # servers as subprocesses, in namespaces

N = 16_000  # 250 elements per reader
RATE = 25.0  # elements/s per reader: the epoch lasts about 10 s however fast the machine (a
# few heartbeats even if the dispatcher stretches the readers to 2 s)
BUDGET_RPS = 130  # 4 workers + 64 readers: readers at 498 ms, workers at 2.5 s


@pytest.fixture(scope="module")
def readers_fleet() -> Iterator[Fleet]:
    with started_fleet(HOSTS) as hosts:
        yield hosts


@pytest.mark.timeout(300)
def test_64_readers_read_an_epoch_exactly_once_at_the_intervals_announced(
        readers_fleet: Fleet) -> None:
    run = run_readers(readers_fleet, N, processes=8, threads=8, rate=RATE,
                      budget_rps=BUDGET_RPS, period_s=0.1, timeout_s=200)
    result = tally_all(run.outs, N)
    assert result.done and result.missing == result.duplicated == 0, str(result)
    assert len(run.reader_rss_mb) == 8, run.outputs  # every trainer process ended cleanly

    figures = measure(run)  # asserts that the 64 readers were attached together
    # While the 64 readers were attached, the dispatcher announced at least what that
    # population alone asks (refusals on a busy machine may stretch it further), in its
    # status and in its metrics.
    announced = statistics.median(s["load"]["client_heartbeat_ms"] for s in run.status
                                  if len(s["ages"]) >= 64)
    assert announced >= figures.predicted_client_ms, (announced, figures)
    gauges = [m["metrics"]['tds_dispatcher_heartbeat_interval_seconds{peer="client"}']
              for m in run.metrics if m["metrics"].get("tds_dispatcher_clients", 0) >= 64]
    assert gauges and statistics.median(gauges) * 1000 >= figures.predicted_client_ms, gauges
    # Each reader beat at the interval announced (as the dispatcher saw its beats): at the
    # readers' own 100 ms the ratio would be 0.2 or less.
    assert len(figures.reader_ratios) >= 56, figures  # nearly every reader beat 3 times
    assert all(0.5 <= ratio <= 2.0 for ratio in figures.reader_ratios), sorted(
        figures.reader_ratios)
    # Its load as it reports it is its CPU as /proc counts it.
    assert abs(figures.reported_cores - figures.cores) <= 0.5 * figures.cores + 0.05, figures

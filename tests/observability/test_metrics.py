"""Prometheus metrics of a real dispatcher, worker and trainer, scraped during an epoch."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

import torch_dataservice as tds
from tests.conftest import wait_until
from torch_dataservice.client.api import reader_stats
from torch_dataservice.dispatcher.status import optimal_workers
from torch_dataservice.observability.client import register_client_metrics


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of http://127.0.0.1:PORT/metrics, keyed by (name, sorted labels)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    samples = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def total(samples: dict, name: str, **labels: str) -> float:
    wanted = set(labels.items())
    return sum(v for (n, lbl), v in samples.items() if n == name and wanted <= set(lbl))


@pytest.fixture
def trainer_port():
    """The trainer's client metrics, served from a registry of its own (the user's path)."""
    registry = CollectorRegistry()
    register_client_metrics(registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    yield server.server_port
    server.shutdown()
    server.server_close()


def _slow(x: int) -> int:
    time.sleep(0.02)
    return x


@pytest.mark.timeout(60)
def test_counters_of_dispatcher_workers_and_trainer_agree(cluster_factory, trainer_port):
    cluster = cluster_factory(0, metrics_port=0)
    workers = [cluster.add_worker(metrics_port=0) for _ in range(2)]
    before = scrape(trainer_port)
    pipeline = tds.Pipeline.range(3000).apply(
        tds.distribute("distributed_epoch", cluster.target, target_workers="ANY"))
    assert sorted(pipeline) == list(range(3000))

    sent = [scrape(w.metrics_port) for w in workers]
    produced = sum(total(s, "tds_worker_elements_total") for s in sent)
    assert produced == 3000  # exactly once: every element sent once, by some worker
    assert sum(total(s, "tds_worker_bytes_sent_total", transport="tcp") for s in sent) > 0
    after = scrape(trainer_port)
    received = (total(after, "tds_client_elements_total", rank="0")
                - total(before, "tds_client_elements_total", rank="0"))
    assert received == produced
    assert (total(after, "tds_client_batches_total", rank="0")
            - total(before, "tds_client_batches_total", rank="0")) == 3000
    dispatcher = scrape(cluster.dispatcher.metrics_port)
    assert total(dispatcher, "tds_build_info") == 1
    assert total(dispatcher, "tds_dispatcher_workers") == 2
    assert total(dispatcher, "tds_dispatcher_splits_total") > 0
    assert total(dispatcher, "tds_dispatcher_rpc_seconds_count", method="GetSplit") > 0
    assert ("tds_dispatcher_journal_fsync_seconds_count", ()) in dispatcher
    # Stage times arrive with the executors' messages: the work is accounted for.
    wait_until(lambda: sum(total(scrape(w.metrics_port), "tds_worker_elements_produced_total")
                           for w in workers) == 3000, 10, "stage totals of every executor")
    _check_optimal_workers(cluster)


def _check_optimal_workers(cluster) -> None:
    """A trainer that does nothing but read a slow map: 2 workers are too few."""
    pipeline = tds.Pipeline.range(300).map(_slow).apply(
        tds.distribute("distributed_epoch", cluster.target))
    estimate = None
    # The latest estimate, read only near the end (the window has forgotten the fast epoch
    # before by then): a scrape is work the consumer does besides waiting, and scraping every
    # 0.3 s on a loaded machine made it look busy enough for 2 workers to keep up.
    for index, _ in enumerate(pipeline):
        if index in (240, 270, 295):
            samples = scrape(cluster.dispatcher.metrics_port)
            found = [v for (n, _), v in samples.items() if n == "tds_dispatcher_optimal_workers"]
            estimate = found[0] if found else estimate
    assert estimate is not None and estimate > 2, estimate
    stages = scrape(cluster.workers[0].metrics_port)
    compute = total(stages, "tds_worker_stage_seconds_total", stage="compute")
    encode = total(stages, "tds_worker_stage_seconds_total", stage="encode")
    assert compute > 10 * encode  # the sleeping map is where the time goes


def _wait_fraction(pipeline, stats_of, consumer_sleep_s: float) -> float:
    """Seconds blocked in __next__ per second of reading, after a warm-up of 5 elements."""
    iterator = iter(pipeline)
    for _ in range(5):
        next(iterator)
    wait0, t0 = stats_of()["wait_seconds"], time.perf_counter()
    for _ in range(40):
        next(iterator)
        time.sleep(consumer_sleep_s)
    fraction = (stats_of()["wait_seconds"] - wait0) / (time.perf_counter() - t0)
    for _ in iterator:
        pass
    return fraction


@pytest.mark.timeout(60)
def test_wait_grows_when_the_pipeline_is_slow_and_not_when_it_is_fast(shared_cluster):
    cluster = shared_cluster
    slow = tds.Pipeline.range(60).map(_slow).apply(
        tds.distribute("distributed_epoch", cluster.target))
    fast = tds.Pipeline.range(60).apply(tds.distribute("distributed_epoch", cluster.target))
    slow_fraction = _wait_fraction(slow, lambda: reader_stats(slow), 0.0)
    fast_fraction = _wait_fraction(fast, lambda: reader_stats(fast), 0.02)
    assert slow_fraction > 0.5, slow_fraction  # a consumer that does nothing waits for a map
    assert fast_fraction < 0.2, fast_fraction  # ... and a slow consumer of a fast one does not
    stats = reader_stats(slow)
    assert stats["batches"] == stats["elements"] == 60
    assert set(stats["per_worker"]) <= {w.address for w in cluster.workers}


@pytest.mark.timeout(10)
def test_optimal_workers_is_demand_over_mean_capacity() -> None:
    assert optimal_workers([50.0, 50.0], [40.0, 60.0]) == 2
    assert optimal_workers([101.0], [50.0]) == 3
    assert optimal_workers([1.0], [1000.0]) == 1  # at least one
    assert optimal_workers([], [10.0]) == 0  # no estimate without a consumer rate

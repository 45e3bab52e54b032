"""The cluster status: one pure function of the state, the soft state and the observed load.

`torch-dataservice status` prints it and the dispatcher's metrics re-expose it. Rates are the
change of heartbeated totals over the last few seconds (observability/rates.py).

Optimal workers, as tf.data service's autoscaler estimates it (auto_scaler.cc): the number of
workers whose production matches what the consumers would take if they never waited,

    optimal = max(1, ceil(sum of consumer demand rates / mean worker capacity))

- a consumer's demand rate is batches per second of the time it was *not* blocked in
  `__next__`: delta(batches) / (delta(time) - delta(wait)) over the window (tf.data: 1 /
  target processing time, the time between a consumer's requests);
- a worker's capacity is elements per second of its executors' busy time (compute + encode),
  times its executor processes: delta(produced) / delta(busy) * processes (tf.data: 1 /
  processing time per element), averaged over the workers serving the iteration.

A consumer that never waits still gets an estimate: fewer workers may do. No estimate (0)
until both sides have reported two heartbeats apart.
"""

from __future__ import annotations

import math

from torch_dataservice.dispatcher import affinity
from torch_dataservice.dispatcher.observe import ClientSample, DispatcherObserver, WorkerSample
from torch_dataservice.dispatcher.soft import SoftState
from torch_dataservice.dispatcher.state import DispatcherState, Iteration
from torch_dataservice.observability.metrics import build_versions
from torch_dataservice.policies import ShardingPolicy
from torch_dataservice.proto import status_pb2

MIN_WORKING_SHARE = 0.01


def cluster_status(state: DispatcherState, soft: SoftState, observed: DispatcherObserver,
                   now: float, worker_timeout_s: float) -> status_pb2.GetClusterStatusResponse:
    version, protocol = build_versions()
    reply = status_pb2.GetClusterStatusResponse(
        uptime_s=max(0.0, now - observed.started), version=version, protocol=protocol)
    capacity: dict[str, float] = {}
    for address in sorted(state.workers):
        worker = reply.workers.add(address=address,
                                   tasks=len(state.workers[address].task_ids),
                                   held_splits=affinity.held_count(soft, address))
        worker.heartbeat_age_s = max(0.0, now - soft.worker_seen.get(address, now))
        worker.state = "up" if worker.heartbeat_age_s < worker_timeout_s / 2 else "late"
        sample = observed.workers.get(address)
        if sample is not None:
            _fill_worker(worker, sample)
            capacity[address] = worker.capacity_per_s
    for client_id in sorted(state.clients):
        client_sample = observed.clients.get(client_id)
        client = reply.clients.add(client_id=client_id, iteration_id=state.clients[client_id])
        client.heartbeat_age_s = max(0.0, now - soft.client_seen.get(client_id, now))
        if client_sample is not None:
            _fill_client(client, client_sample)
    for iteration_id in sorted(state.iterations):
        iteration = state.iterations[iteration_id]
        if not iteration.garbage_collected:
            reply.iterations.append(
                _iteration_status(state, observed, iteration, capacity))
    return reply


def _fill_worker(worker: status_pb2.WorkerStatus, sample: WorkerSample) -> None:
    load = sample.load
    worker.elements_sent, worker.bytes_sent = load.elements_sent, load.bytes_sent
    worker.buffered_elements = load.buffered_elements
    worker.cache_bytes, worker.cache_hits = load.cache_bytes, load.cache_hits
    worker.cache_misses, worker.cache_evictions = load.cache_misses, load.cache_evictions
    worker.elements_per_s = sample.window.rate(0)
    worker.bytes_per_s = sample.window.rate(1)
    _, (_, _, produced, busy) = sample.window.delta()
    if busy <= 0:  # idle over the window: its lifetime figures
        produced, busy = load.elements_produced, load.busy_seconds
    if busy > 0 and produced > 0:
        worker.capacity_per_s = produced / busy * max(1, load.processes)


def _fill_client(client: status_pb2.ClientStatus, sample: ClientSample) -> None:
    client.rank = sample.rank
    latest = sample.window.latest
    client.batches, client.wait_seconds = int(latest[0]), latest[1]
    span, (batches, wait, _, _) = sample.window.delta()
    if span > 0:
        client.wait_fraction = min(1.0, wait / span)
        client.batches_per_s = batches / span
    if batches > 0:
        client.wait_per_batch_s = wait / batches


def demand_rate(sample: ClientSample) -> float:
    """Batches/s the consumer would take if it never waited (0: unknown)."""
    span, (batches, wait, _, _) = sample.window.delta()
    # A consumer that only waited would take far more: its working time is bounded below.
    working = max(span - wait, MIN_WORKING_SHARE * span)
    return batches / working if batches > 0 and working > 0 else 0.0


def optimal_workers(demands: list[float], capacities: list[float]) -> int:
    """tf.data service's estimate (module docstring); 0 when either side is unknown."""
    demands = [d for d in demands if d > 0]
    capacities = [c for c in capacities if c > 0]
    if not demands or not capacities:
        return 0
    return max(1, math.ceil(sum(demands) / (sum(capacities) / len(capacities))))


def _iteration_status(state: DispatcherState, observed: DispatcherObserver,
                      iteration: Iteration, capacity: dict[str, float]
                      ) -> status_pb2.IterationStatus:
    job = state.jobs[iteration.job_id]
    config = job.config
    tasks = list(state.iteration_tasks(iteration))
    status = status_pb2.IterationStatus(
        iteration_id=iteration.iteration_id, job_id=job.job_id, dataset_id=config.dataset_id,
        job_name=job.name, mode=_mode(config.sharding_policy), clients=len(iteration.client_ids),
        num_consumers=config.num_consumers if config.HasField("num_consumers") else 0,
        finished=state.is_finished(iteration), tasks=len(tasks),
        repetition=iteration.repetition)
    dataset = state.datasets.get(config.dataset_id)
    if config.sharding_policy == ShardingPolicy.DYNAMIC and dataset is not None:
        handed = (iteration.cursor_repetition * dataset.definition.num_splits
                  + iteration.cursor_index + len(iteration.ahead))
        status.splits_handed = handed
        status.splits_done = max(0, handed - len(iteration.delivered) - len(iteration.requeued))
    samples = [observed.clients[c] for c in sorted(iteration.client_ids)
               if c in observed.clients]
    status.elements_delivered = observed.released_elements.get(iteration.iteration_id, 0) + sum(
        int(s.window.latest[2]) for s in samples if s.window.latest)
    serving = {t.worker_address for t in tasks if not t.finished}
    status.optimal_workers = optimal_workers(
        [demand_rate(s) for s in samples], [capacity.get(a, 0.0) for a in sorted(serving)])
    return status


def _mode(policy: int) -> str:
    try:
        return ShardingPolicy(policy).name
    except ValueError:
        return str(policy)

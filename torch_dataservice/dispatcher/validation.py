"""What the dispatcher refuses, and why: checks of registrations and jobs (pure).

Each check raises ValueError (INVALID_ARGUMENT) or LookupError (NOT_FOUND) with a message a
user can act on; none reads anything but its arguments.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch_dataservice import version
from torch_dataservice.dispatcher import resume
from torch_dataservice.dispatcher.state import DispatcherState
from torch_dataservice.errors import FailedPreconditionError, VersionMismatchError
from torch_dataservice.policies import TARGET_WORKERS, ShardingPolicy, TargetWorkers, policy_name
from torch_dataservice.proto import common_pb2, dispatcher_pb2


def check_dependencies(state: DispatcherState, definition: common_pb2.DatasetDef) -> None:
    """A worker fetches the datasets a pipeline refers to before the pipeline; one missing
    (e.g. a dispatcher without a journal restarted) is NOT_FOUND, so the client registers
    it again."""
    for dependency in definition.depends_on:
        if dependency not in state.datasets:
            raise LookupError(f"dataset {dependency!r}, which this pipeline refers to, "
                              "is not registered")


# Coordinated reads keep per-consumer state and compare consumer sets at every heartbeat: a
# bound keeps one request from asking for billions (found by fuzzing: 2**31 - 1 consumers
# made a heartbeat build a set of that size, and the dispatcher was killed for its memory).
MAX_CONSUMERS = 1 << 16


def check_consumer(request: dispatcher_pb2.ClientHeartbeatRequest,
                   config: common_pb2.JobConfig) -> None:
    """A coordinated reader's consumer index is one of its job's."""
    if not 0 <= request.consumer_index < config.num_consumers:
        raise ValueError(f"consumer_index={request.consumer_index} is out of range "
                         f"[0, {config.num_consumers}) of this job")


def check_dataset_limits(state: DispatcherState, definition: common_pb2.DatasetDef,
                         max_bytes: int, max_datasets: int) -> None:
    """A new registration fits the dispatcher's limits (DispatcherConfig.max_dataset_bytes,
    max_datasets): ValueError / FailedPreconditionError naming the limit and its flag."""
    size = definition.ByteSize()
    if size > max_bytes:
        raise ValueError(f"the dataset definition is {size} bytes, more than the dispatcher "
                         f"accepts ({max_bytes}: DispatcherConfig.max_dataset_bytes, "
                         "--max-dataset-bytes); keep large data out of the pipeline (read it "
                         "from files inside it) or raise the limit")
    if len(state.datasets) >= max_datasets:
        raise FailedPreconditionError(
            f"the dispatcher holds {len(state.datasets)} datasets, its limit "
            f"(DispatcherConfig.max_datasets, --max-datasets): raise it, or reuse datasets "
            "(the same pipeline registered again gets the same id)")


def check_worker_limit(state: DispatcherState, max_workers: int) -> None:
    """A new worker fits DispatcherConfig.max_workers (FailedPreconditionError otherwise)."""
    if len(state.workers) >= max_workers:
        raise FailedPreconditionError(
            f"the dispatcher holds {len(state.workers)} workers, its limit "
            f"(DispatcherConfig.max_workers, --max-workers)")


def validate_job(config: common_pb2.JobConfig, dataset: common_pb2.DatasetDef,
                 worker_addresses: Sequence[str]) -> None:
    policy = config.sharding_policy
    if policy not in ShardingPolicy.__members__.values():
        raise ValueError(f"unknown sharding policy {policy}")
    policy = ShardingPolicy(policy)
    if config.target_workers and config.target_workers not in TARGET_WORKERS:  # "": AUTO
        raise ValueError(f"target_workers must be one of {TARGET_WORKERS}, "
                         f"got {config.target_workers[:100]!r}")
    if config.HasField("num_consumers") and not 0 < config.num_consumers <= MAX_CONSUMERS:
        raise ValueError(f"num_consumers={config.num_consumers} is out of range "
                         f"[1, {MAX_CONSUMERS}]")
    if dataset.shared_object:
        raise ValueError(f"dataset {config.dataset_id} is a shared object for other "
                         "pipelines to refer to, not a pipeline to read")
    if policy == ShardingPolicy.DYNAMIC and not dataset.splittable:
        raise ValueError(
            "sharding policy DYNAMIC needs a splittable source (range, from_items, "
            "list_files or from_dataset); this pipeline's source is not splittable"
        )
    if config.cross_trainer_cache and config.HasField("num_consumers"):
        raise ValueError("cross_trainer_cache cannot be combined with coordinated reads "
                         f"(num_consumers={config.num_consumers})")
    if config.HasField("num_consumers") and config.target_workers == TargetWorkers.LOCAL:
        raise ValueError("coordinated reads (num_consumers) read every worker of the job: "
                         "target_workers='LOCAL' is not supported with them")
    if policy.is_static:
        _validate_static(policy, config, dataset, worker_addresses)
    resume.check(config, dataset)


def _validate_static(policy: ShardingPolicy, config: common_pb2.JobConfig,
                     dataset: common_pb2.DatasetDef, worker_addresses: Sequence[str]) -> None:
    name = policy.name
    if config.target_workers == TargetWorkers.ANY:
        raise ValueError(
            f"sharding policy {name} requires reading from local workers: use "
            "target_workers='LOCAL' or 'AUTO' (which means LOCAL for static sharding), "
            "got target_workers='ANY'")
    if not worker_addresses:
        raise ValueError(
            f"sharding policy {name} needs a fixed worker list: start the dispatcher "
            "with DispatcherConfig(worker_addresses=[...]) / --worker-addresses"
        )
    num_workers = len(worker_addresses)
    if policy == ShardingPolicy.FILE and not dataset.file_based:
        raise ValueError(
            "sharding policy FILE needs a list_files or from_tar_shards source; use DATA or "
            "FILE_OR_DATA"
        )
    file_policy = policy in (ShardingPolicy.FILE, ShardingPolicy.FILE_OR_DATA)
    if file_policy and dataset.file_based and dataset.num_files < num_workers:
        raise ValueError(
            f"sharding policy {name}: the pipeline has fewer files ({dataset.num_files}) "
            f"than workers ({num_workers})"
        )


def check_matching_job(existing: common_pb2.JobConfig, requested: common_pb2.JobConfig) -> None:
    """Joining a named job with a different configuration is an error, not a silent join."""
    def describe(config: common_pb2.JobConfig, name: str) -> object:
        if name == "sharding_policy":
            return policy_name(config.sharding_policy)
        if name == "num_consumers":
            return config.num_consumers if config.HasField("num_consumers") else None
        return getattr(config, name)

    for name in ("sharding_policy", "num_consumers", "cross_trainer_cache", "target_workers",
                 "resume"):
        old, new = describe(existing, name), describe(requested, name)
        if old != new:
            raise ValueError(
                f"job {existing.job_name!r} already exists with {name}={old!r}; "
                f"got {name}={new!r}"
            )


_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9_.-]{0,251}[A-Za-z0-9])?)$")


def check_worker(request: dispatcher_pb2.WorkerHeartbeatRequest) -> None:
    """A worker's address is what every client dials: HOST:PORT with a valid host name or
    address and a port in range; so is its data port."""
    address = request.worker_address
    host, sep, port = address.rpartition(":")
    if (not sep or not _HOST.match(host) or any(len(label) > 63 for label in host.split("."))
            or not port.isdigit() or not 0 < int(port) < 65536):
        raise ValueError(f"worker address {address[:300]!r} is not HOST:PORT")
    if not 0 <= request.data_port < 65536:
        raise ValueError(f"data_port={request.data_port} is not a port")
    check_version(request, f"worker {address}")


def check_version(request: dispatcher_pb2.WorkerHeartbeatRequest
                  | dispatcher_pb2.GetOrCreateJobRequest, who: str) -> None:
    """A peer on another wire protocol or Python major.minor is refused with both sides'
    versions (VersionMismatchError -> FAILED_PRECONDITION, see rpc.servicer_method).

    A request without versions is let through: it comes from a tool or test that speaks the
    protocol directly (every WorkerServer and reader sends them, and no release predates
    the check)."""
    if not request.HasField("build"):
        return
    peer, mine = version.from_message(request.build), version.current()
    why = mine.incompatibility(peer)
    if why is not None:
        raise VersionMismatchError(
            f"{who} runs {peer.describe()}, but the dispatcher runs {mine.describe()}: {why}")


def worker_index(address: str, worker_addresses: Sequence[str]) -> int:
    """A worker's index in the fixed worker list of static sharding (-1 without one)."""
    if not worker_addresses:
        return -1
    if address not in worker_addresses:
        raise ValueError(
            f"worker {address} is not in the dispatcher's fixed worker list "
            f"{list(worker_addresses)}; start it with one of those addresses"
        )
    return list(worker_addresses).index(address)

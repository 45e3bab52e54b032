"""The service across hosts, started as deploy/slurm/tds.sh starts it (the Slurm pattern):
the dispatcher on host A writes its port file to the shared filesystem, workers on B and C
(bound to every interface) wait for it, trainers on D read. Without TLS (a shared token);
tests/fleet/test_fleet_tls.py has the same with TLS.

The servers are shared by the module (starting them costs seconds); the refused worker runs on
host E; the drain test drains B, so it runs after the tests that read from B.
"""

from __future__ import annotations

import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.fault.helpers import tally
from tests.fleet.helpers import (
    METRICS_PORT,
    SAMPLES,
    assert_exactly_once,
    metrics,
    ranks,
    torchrun,
)
from tests.fleet.hosts import Fleet, Host, HostProcess, can_connect
from torch_dataservice import version

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # servers as subprocesses, in namespaces

TDS_SH = REPO / "deploy" / "slurm" / "tds.sh"
TOKEN = "fleet-shared-token"
DISPATCHER_PORT, WORKER_PORT, DATA_PORT = 5000, 5001, 5002
ROUTABLE = re.compile(r"^198\.51\.100\.\d+:\d+$")


@dataclass
class Service:
    dispatcher: HostProcess
    workers: dict[str, HostProcess]
    target: str  # grpc://HOST:PORT, as tds_wait_dispatcher printed it
    run_dir: Path


def slurm_env(fleet: Fleet, run_dir: Path, **extra: str) -> dict[str, str]:
    """What train.sbatch exports to its steps, plus fixed ports and fast heartbeats."""
    return fleet.env(**{
        "TDS_RUN_DIR": str(run_dir), "TDS_CMD": f"{sys.executable} -m torch_dataservice",
        "TDS_PORT": str(DISPATCHER_PORT), "TDS_WORKER_PORT": str(WORKER_PORT),
        "TDS_DATA_PORT": str(DATA_PORT), "SLURM_JOB_ID": "77", "SLURM_CPUS_PER_TASK": "1",
        "TORCH_DATASERVICE_TOKEN": TOKEN, "TORCH_DATASERVICE_METRICS_PORT": str(METRICS_PORT),
        "TORCH_DATASERVICE_HEARTBEAT_INTERVAL_MS": "100", **extra})


def slurm_step(host: Host, function: str, env: dict[str, str]) -> HostProcess:
    return host.spawn(argv=["bash", "-c", f"source '{TDS_SH}' && {function}"], env=env)


@pytest.fixture(scope="module")
def service(fleet: Fleet) -> Service:
    run_dir = fleet.shared / "slurm-run"
    run_dir.mkdir()
    env = slurm_env(fleet, run_dir)
    # As train.sbatch: the workers first (they wait for the port file), then the dispatcher.
    workers = {name: slurm_step(fleet[name], "tds_worker", env) for name in ("b", "c")}
    dispatcher = slurm_step(fleet["a"], "tds_dispatcher", env)
    dispatcher.wait_serving()
    for worker in workers.values():
        worker.wait_serving()
    waited = fleet["d"].run(["bash", "-c", f"source '{TDS_SH}' && tds_wait_dispatcher 30"],
                            timeout_s=40, env=env)
    assert waited.returncode == 0, waited.stderr
    return Service(dispatcher, workers, waited.stdout.strip(), run_dir)


def read(fleet: Fleet, service: Service, n: int, out: Path, epochs: int = 1,
         rate: float = 0.0) -> HostProcess:
    """tests/fleet/client.py on host D: `epochs` DYNAMIC epochs of range(n), epoch e's
    elements in `out`.e. A dropped data port is given up after 1 s (default 5 s)."""
    return fleet["d"].spawn(
        argv=[sys.executable, "-m", "tests.fleet.client", service.target, str(n), str(epochs),
              str(out), str(rate)],
        env=fleet.env(TORCH_DATASERVICE_TOKEN=TOKEN, TORCH_DATASERVICE_DATA_PORT_TIMEOUT_S="1"))


@pytest.mark.timeout(150)
def test_slurm_functions_bring_up_servers_that_advertise_routable_addresses(
        fleet: Fleet, service: Service) -> None:
    """Bound to 0.0.0.0, every server tells the others its host's address on the fleet's
    network; the port file on the shared filesystem names the dispatcher that way."""
    a = fleet["a"]
    assert service.target == f"grpc://{a.address}:{DISPATCHER_PORT}"
    assert (service.run_dir / "dispatcher.addr").read_text() == f"{a.address}:{DISPATCHER_PORT}\n"
    assert (service.run_dir / "journal").is_dir()  # --fault-tolerant --work-dir
    for name, worker in service.workers.items():
        assert worker.address == f"{fleet[name].address}:{WORKER_PORT}", worker.output
        assert ROUTABLE.match(worker.address) and not worker.address.startswith("0.0.0.0")
        assert f"(gRPC port {WORKER_PORT}, data port {DATA_PORT})" in worker.output
        assert worker.address in service.dispatcher.output  # it logged the worker joining
        assert f"metrics at http://{fleet[name].address}:{METRICS_PORT}/metrics" in (
            worker.output)
    joined = [line for line in service.dispatcher.lines if " joined " in line]
    assert len(joined) == 2 and not any("0.0.0.0" in line for line in joined), joined


@pytest.mark.timeout(150)
def test_torchrun_reads_a_dynamic_epoch_and_a_map_style_loader_over_the_data_ports(
        fleet: Fleet, service: Service) -> None:
    before = {name: metrics(fleet, fleet[name]) for name in service.workers}
    out = fleet.shared / "plain"
    torchrun(fleet, service.target, out, fleet.env(TORCH_DATASERVICE_TOKEN=TOKEN))
    records = ranks(out)
    assert [r["world_size"] for r in records] == [2, 2]
    assert_exactly_once([r["pipeline"] for r in records], SAMPLES)
    assert_exactly_once([r["loader"] for r in records], SAMPLES)
    assert [len(r["loader"]) for r in records] == [SAMPLES // 2] * 2
    served = {address for r in records for address in r["loader_stats"]["per_worker"]}
    assert served == {w.address for w in service.workers.values()}
    for name in service.workers:  # the bytes crossed hosts on the TCP data ports
        after = metrics(fleet, fleet[name])
        assert after["tcp"] > before[name]["tcp"], (name, after)  # snappy: few bytes
        assert after["grpc"] == after["unix"] == after["local"] == 0, (name, after)


@pytest.mark.timeout(150)
def test_a_blocked_data_port_is_read_over_grpc_with_one_warning(
        fleet: Fleet, service: Service) -> None:
    """A firewall between the hosts drops the worker's data port (not its gRPC port): the
    reader on D falls back to gRPC for that worker, says so once, and loses nothing; its
    next epoch reads that worker over gRPC from the start (no second wait, no warning)."""
    b, d = fleet["b"], fleet["d"]
    n = 2000
    before = metrics(fleet, b)
    out = fleet.shared / "blocked"
    with fleet.block_tcp_port(b, DATA_PORT):
        assert not can_connect(d, b.address, DATA_PORT)  # the block really drops
        assert can_connect(d, b.address, WORKER_PORT)
        reader = read(fleet, service, n, out, epochs=2)
        code = reader.wait_exit(90)
        assert fleet.dropped_packets(b) > 0
    assert code == 0, reader.output[-3000:]
    for epoch in range(2):
        result = tally(Path(f"{out}.{epoch}"), n)
        assert result.done and result.missing == result.duplicated == 0, (epoch, str(result))
    warnings = [line for line in reader.lines if "cannot reach the data port" in line]
    assert len(warnings) == 1, reader.output[-3000:]
    assert f"{b.address}:{DATA_PORT} of worker {service.workers['b'].address}" in warnings[0]
    (second,) = [float(line.split()[-2]) for line in reader.lines if line.startswith("epoch 1:")]
    assert second < 10, reader.output  # not another round of data-port timeouts
    after = metrics(fleet, b)
    assert after["grpc"] > before["grpc"], (after, reader.output[-3000:])  # B's share
    assert after["tcp"] == before["tcp"], (before, after)


@pytest.mark.timeout(150)
def test_a_worker_sigtermed_mid_epoch_drains_and_the_epoch_is_exactly_once(
        fleet: Fleet, service: Service) -> None:
    """Worker B is SIGTERMed while it serves an epoch to a reader on D (throttled to last
    about 6 s from its first element)."""
    b = fleet["b"]
    leaving = service.workers["b"]
    before = metrics(fleet, b)["tcp"]
    n = 9000
    out = fleet.shared / "drain"
    reader = read(fleet, service, n, out, rate=1500)
    deadline = time.monotonic() + 60
    while tally(Path(f"{out}.0"), n).delivered < n // 8:
        assert time.monotonic() < deadline and reader.proc.poll() is None, reader.output
        time.sleep(0.05)
    assert metrics(fleet, b)["tcp"] > before  # B serves this epoch
    leaving.signal(signal.SIGTERM)
    assert tally(Path(f"{out}.0"), n).delivered < n * 0.6, "the epoch was nearly over"
    assert leaving.wait_exit(40) == 0, leaving.output
    assert reader.wait_exit(90) == 0, reader.output[-3000:]
    result = tally(Path(f"{out}.0"), n)
    assert result.done and result.missing == result.duplicated == 0, str(result)
    assert "draining" in leaving.output and "left the dispatcher" in leaving.output
    assert f"worker {leaving.address} left (drained)" in service.dispatcher.output


@pytest.mark.timeout(120)
def test_a_worker_on_an_incompatible_version_is_refused_and_exits_non_zero(
        fleet: Fleet, service: Service) -> None:
    mine = version.current()
    env = fleet.env(TORCH_DATASERVICE_TOKEN=TOKEN, **{version.TEST_PROTOCOL_ENV: "99"})
    worker = fleet["e"].spawn("worker", "--dispatcher", service.target, "--host", "0.0.0.0",
                              "--processes", "0", env=env)  # no executors: refused sooner
    code = worker.wait_exit(60)
    assert code != 0, worker.output
    assert "version mismatch" in worker.output, worker.output
    assert "protocol 99" in worker.output and f"protocol {mine.protocol}" in worker.output
    assert not any(line.startswith("worker serving at") for line in worker.lines)
    assert "protocol 99" in service.dispatcher.output  # the dispatcher logged the refusal


@pytest.mark.timeout(120)
def test_the_slurm_steps_stop_cleanly_workers_first(fleet: Fleet, service: Service) -> None:
    """The end of train.sbatch: SIGTERM drains the workers (exit 0), then the dispatcher.
    (B may have been drained already.)"""
    for worker in service.workers.values():
        worker.signal(signal.SIGTERM)
    for worker in service.workers.values():
        assert worker.wait_exit(40) == 0, worker.output
    service.dispatcher.signal(signal.SIGTERM)
    assert service.dispatcher.wait_exit(30) == 0, service.dispatcher.output

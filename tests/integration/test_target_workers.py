"""target_workers: "ANY" reads every worker over the network, "LOCAL" only workers on this host
(a worker in this process without gRPC), "AUTO" = LOCAL under static sharding, else every
worker. Unknown values are a ValueError.
"""

from __future__ import annotations

import pytest

import torch_dataservice as tds
from tests.conftest import Cluster
from torch_dataservice.client import transports as reader_module
from torch_dataservice.wire import inprocess as local

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    from tests.conftest import _make_cluster

    made = _make_cluster(2, num_processes=0)
    yield made
    made.stop()


@pytest.fixture
def grpc_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Addresses the reader opened gRPC channels to while reading."""
    calls: list[str] = []
    real = reader_module.channel_to

    def recording(address: str):
        calls.append(address)
        return real(address)

    monkeypatch.setattr(reader_module, "channel_to", recording)
    return calls


@pytest.fixture
def data_port_targets(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """The (transport, host, port) targets the reader fetched from over data ports."""
    targets: list[tuple] = []
    real = reader_module.DataPortPool.fetch

    def recording(self, target, request, on_header=None):
        targets.append(target)
        return real(self, target, request, on_header)

    monkeypatch.setattr(reader_module.DataPortPool, "fetch", recording)
    return targets


def read(cluster: Cluster, target_workers: str, n: int = 10) -> list:
    return list(tds.Pipeline.range(n).apply(tds.distribute(
        "parallel_epochs", cluster.target, target_workers=target_workers)))


def test_unknown_target_workers_is_a_value_error(cluster: Cluster) -> None:
    with pytest.raises(ValueError, match="'SOMEWHERE'"):
        tds.distribute("parallel_epochs", cluster.target, target_workers="SOMEWHERE")
    with pytest.raises(ValueError, match="'local'"):
        tds.from_dataset_id("parallel_epochs", cluster.target, "1000", target_workers="local")


def test_local_reads_from_an_in_process_worker_skip_grpc(
        cluster: Cluster, grpc_calls: list[str]) -> None:
    assert sorted(read(cluster, "LOCAL")) == sorted(list(range(10)) * 2)
    worker_addresses = {w.address for w in cluster.workers}
    assert not worker_addresses & set(grpc_calls), grpc_calls


def test_any_reads_go_over_the_network(cluster: Cluster, grpc_calls: list[str],
                                       data_port_targets: list[tuple]) -> None:
    # The network path is the workers' data ports over TCP (gRPC without them).
    targets = data_port_targets
    assert sorted(read(cluster, "ANY")) == sorted(list(range(10)) * 2)
    assert {("tcp", "127.0.0.1", w._data_port.port) for w in cluster.workers} == set(targets)
    assert not {w.address for w in cluster.workers} & set(grpc_calls), grpc_calls


def test_auto_reads_every_worker_in_process(cluster: Cluster, grpc_calls: list[str]) -> None:
    assert sorted(read(cluster, "AUTO")) == sorted(list(range(10)) * 2)
    assert not {w.address for w in cluster.workers} & set(grpc_calls)


def test_local_without_a_worker_on_this_host_is_an_error(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend this reader runs on another machine than the workers.
    monkeypatch.setattr(local, "HOST_ID", "another-host")
    with pytest.raises(ValueError, match="run elsewhere"):
        read(cluster, "LOCAL")


def test_a_dataloader_reads_the_workers_its_target_workers_names(
        cluster: Cluster, data_port_targets: list[tuple]) -> None:
    targets = data_port_targets
    loader = tds.DataLoader(list(range(12)), batch_size=4, service=cluster.target,
                            target_workers="ANY")
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert targets and {t[0] for t in targets} == {"tcp"}
    targets.clear()
    local_loader = tds.DataLoader(list(range(12)), batch_size=4, service=cluster.target,
                                  target_workers="LOCAL")
    assert [b.tolist() for b in local_loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert not targets  # in-process workers: no data port at all


def test_a_dataloader_refuses_an_unknown_target_workers_before_any_contact() -> None:
    with pytest.raises(ValueError, match="'local'"):
        tds.DataLoader(list(range(4)), service="grpc://127.0.0.1:1", target_workers="local")

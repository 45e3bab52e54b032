"""TLS and mTLS on gRPC and the data port, with certificates made here by `openssl`; and the
reader's fallback to gRPC streaming when a worker's data port cannot be reached."""

from __future__ import annotations

import contextlib
import logging
import shutil
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import torch_dataservice as tds
from tests.builders import OPENSSL, extensions, issue, make_certs
from tests.conftest import HOST, ProcessCluster, free_port
from torch_dataservice import auth
from torch_dataservice.client import data_port as client
from torch_dataservice.client import transports
from torch_dataservice.errors import ServiceUnavailableError
from torch_dataservice.wire.data_port import ACCEPTED, HELLO, MAGIC, VERSION

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(OPENSSL is None, reason="needs the openssl command")]
N = 40


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate and a client certificate (all PEM) in one directory."""
    return make_certs(tmp_path_factory.mktemp("certs"))


def server_tls(certs: Path, mutual: bool = False) -> tds.TLSConfig:
    return tds.TLSConfig(str(certs / "server.pem"), str(certs / "server.key"),
                         str(certs / "ca.pem") if mutual else None)


def trust(monkeypatch: pytest.MonkeyPatch, certs: Path, cert: str | None = None) -> None:
    """This process's clients trust the test CA (and present `cert` when given)."""
    monkeypatch.setenv(auth.TLS_CA_ENV, str(certs / "ca.pem"))
    for env, suffix in ((auth.TLS_CERT_ENV, "pem"), (auth.TLS_KEY_ENV, "key")):
        if cert is None:
            monkeypatch.delenv(env, raising=False)
        else:
            monkeypatch.setenv(env, str(certs / f"{cert}.{suffix}"))


@pytest.fixture
def tls_cluster(certs: Path, monkeypatch: pytest.MonkeyPatch
                ) -> Iterator[tuple[tds.DispatchServer, tds.WorkerServer]]:
    """A dispatcher and a worker in this process serving over TLS (no client certificates)."""
    trust(monkeypatch, certs)
    tls = server_tls(certs)
    dispatcher = tds.DispatchServer(tds.DispatcherConfig(host=HOST, tls=tls))
    worker = None
    try:
        worker = tds.WorkerServer(tds.WorkerConfig(dispatcher.address, host=HOST, tls=tls,
                                                   num_processes=1, heartbeat_interval_ms=100))
        yield dispatcher, worker
    finally:
        if worker is not None:
            worker.stop()
        dispatcher.stop()


def read_epoch(target: str, job_name: str) -> list[int]:
    pipeline = tds.Pipeline.range(N).apply(tds.distribute(
        "distributed_epoch", target, job_name=job_name, target_workers="ANY"))
    return sorted(int(x) for x in pipeline)


@pytest.mark.timeout(10)
def test_tls_config_names_files_it_cannot_read(certs: Path, tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.pem")
    with pytest.raises(ValueError, match="nope.pem"):
        tds.TLSConfig(missing, str(certs / "server.key"))
    with pytest.raises(ValueError, match="ca_file"):
        tds.TLSConfig(str(certs / "server.pem"), str(certs / "server.key"), missing)
    with pytest.raises(ValueError, match="tls must be a TLSConfig"):
        tds.DispatcherConfig(tls="server.pem")  # type: ignore[arg-type]


@pytest.mark.timeout(10)
def test_mtls_stands_in_for_the_token_beyond_loopback(
        certs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    monkeypatch.delenv(auth.ALLOW_UNAUTHENTICATED_ENV, raising=False)
    auth.check_bind("0.0.0.0", server_tls(certs, mutual=True))
    with pytest.raises(ValueError, match="--tls-ca"):
        auth.check_bind("0.0.0.0", server_tls(certs))  # encryption alone lets anyone in


@pytest.mark.timeout(60)
def test_a_dynamic_epoch_travels_over_tls(tls_cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    dispatcher, worker = tls_cluster
    sockets: list[socket.socket] = []
    connect = client._connect_tcp

    def spy(host: str, port: int) -> socket.socket:
        sockets.append(connect(host, port))
        return sockets[-1]

    monkeypatch.setattr(client, "_connect_tcp", spy)
    assert read_epoch(dispatcher.target, "tls-epoch") == list(range(N))
    assert sockets and all(isinstance(s, ssl.SSLSocket) for s in sockets)
    # A plaintext client of the data port gets no answer but the end of the connection.
    with socket.create_connection((HOST, worker.data_port), timeout=5) as plain:
        plain.sendall(HELLO.pack(MAGIC, VERSION, 0))
        try:
            answer = plain.recv(1)  # a TLS alert, or nothing
        except ConnectionResetError:
            answer = b""
        assert answer != ACCEPTED


@pytest.mark.timeout(90)
def test_a_reader_without_the_ca_is_told_tls_within_seconds(
        tls_cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 24.3: before, it retried its whole connect deadline (60 s) on "Socket closed"
    and said nothing of TLS; a plaintext channel against a TLS server is recognisable."""
    dispatcher, _ = tls_cluster
    monkeypatch.delenv(auth.TLS_CA_ENV)
    monkeypatch.delenv("TORCH_DATASERVICE_CONNECT_TIMEOUT_S", raising=False)
    for attempt in (lambda: read_epoch(dispatcher.target, "no-ca"),
                    lambda: tds.register_dataset(dispatcher.target, tds.Pipeline.range(3))):
        began = time.monotonic()
        with pytest.raises(ServiceUnavailableError, match="speaks TLS") as info:
            attempt()
        assert time.monotonic() - began < 10
        assert auth.TLS_CA_ENV in str(info.value)


@pytest.mark.timeout(90)
@pytest.mark.integration
def test_a_cli_worker_without_the_ca_exits_at_once_naming_it(
        certs: Path, process_cluster: ProcessCluster) -> None:
    """Before: it retried the TLS dispatcher for ever, logging "Socket closed"."""
    process_cluster.start_dispatcher("--tls-cert", str(certs / "server.pem"),
                                     "--tls-key", str(certs / "server.key"))
    worker = process_cluster.spawn("worker", "--dispatcher", process_cluster.dispatcher.address,
                                   "--host", HOST, "--processes", "0")
    assert worker.wait_exit(30) == 2, worker.output
    assert "speaks TLS" in worker.output and auth.TLS_CA_ENV in worker.output


@pytest.mark.timeout(10)
def test_client_auth_takes_required_or_none(certs: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    with pytest.raises(ValueError, match="'optional'"):
        tds.TLSConfig(str(certs / "server.pem"), str(certs / "server.key"),
                      str(certs / "ca.pem"), client_auth="optional")
    trusting = tds.TLSConfig(str(certs / "server.pem"), str(certs / "server.key"),
                             str(certs / "ca.pem"), client_auth="none")
    assert not trusting.mutual and server_tls(certs, mutual=True).mutual
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    monkeypatch.delenv(auth.ALLOW_UNAUTHENTICATED_ENV, raising=False)
    with pytest.raises(ValueError, match="without authentication"):
        auth.check_bind("0.0.0.0", trusting)  # TLS without client certificates lets anyone in


@pytest.mark.timeout(120)
@pytest.mark.integration
def test_cli_servers_with_a_ca_and_no_client_auth(
        certs: Path, process_cluster: ProcessCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """TLS without mTLS for CLI servers: --tls-ca is the CA they trust when they dial (the
    worker its dispatcher), and --tls-client-auth none (or its variable) asks readers for no
    certificate."""
    flags = ["--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
             "--tls-ca", str(certs / "ca.pem")]
    process_cluster.start_dispatcher(*flags, "--tls-client-auth", "none")
    process_cluster.env["TORCH_DATASERVICE_TLS_CLIENT_AUTH"] = "none"
    process_cluster.start_worker(*flags, "--data-port", str(free_port()))
    trust(monkeypatch, certs)  # the CA, and no client certificate
    assert read_epoch(process_cluster.target, "tls-no-client-auth") == list(range(N))


@pytest.mark.timeout(120)
def test_cli_servers_with_mtls(certs: Path, process_cluster: ProcessCluster,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    flags = ["--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
             "--tls-ca", str(certs / "ca.pem")]
    process_cluster.start_dispatcher(*flags)
    process_cluster.start_worker(*flags, "--data-port", str(free_port()))
    trust(monkeypatch, certs, cert="client")
    assert read_epoch(process_cluster.target, "mtls-epoch") == list(range(N))
    trust(monkeypatch, certs)  # the CA, but no client certificate
    monkeypatch.setenv("TORCH_DATASERVICE_CONNECT_TIMEOUT_S", "1")
    with pytest.raises(ServiceUnavailableError, match="TLS"):
        read_epoch(process_cluster.target, "mtls-refused")


@contextlib.contextmanager
def tls_dispatcher_and_worker(certs: Path, worker_tls: tds.TLSConfig
                              ) -> Iterator[tuple[tds.DispatchServer, tds.WorkerServer]]:
    """A TLS dispatcher (no mTLS) and one worker serving with `worker_tls`, stopped after."""
    dispatcher = tds.DispatchServer(tds.DispatcherConfig(host=HOST, tls=server_tls(certs)))
    worker = None
    try:
        worker = tds.WorkerServer(tds.WorkerConfig(
            dispatcher.address, host=HOST, num_processes=1, heartbeat_interval_ms=100,
            tls=worker_tls))
        yield dispatcher, worker
    finally:
        if worker is not None:
            worker.stop()
        dispatcher.stop()


@pytest.mark.timeout(60)
def test_a_worker_certificate_that_does_not_name_its_address_fails_the_read_clearly(
        certs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found across hosts: a certificate that names a host name while the worker advertises
    its address made readers retry "unreachable" for ever; it is an error, at once."""
    for name in ("ca.pem", "ca.key"):
        shutil.copy(certs / name, tmp_path / name)
    (tmp_path / "ext.cnf").write_text(extensions("DNS:elsewhere.invalid"))
    issue("elsewhere", tmp_path)
    trust(monkeypatch, certs)
    worker_tls = tds.TLSConfig(str(tmp_path / "elsewhere.pem"), str(tmp_path / "elsewhere.key"))
    with tls_dispatcher_and_worker(certs, worker_tls) as (dispatcher, worker):
        # Before: "unreachable, retrying" until the test's timeout.
        with pytest.raises(ServiceUnavailableError, match="does not verify") as info:
            read_epoch(dispatcher.target, "bad-san")
        assert worker.address in str(info.value) and auth.TLS_CA_ENV in str(info.value)


@pytest.mark.timeout(60)
def test_a_worker_that_refuses_the_readers_certificate_fails_the_read_clearly(
        certs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dispatcher without mTLS and a worker with it (a CLI worker given the CA through
    TORCH_DATASERVICE_TLS_CA requires client certificates): a reader without one is told."""
    trust(monkeypatch, certs)
    with tls_dispatcher_and_worker(certs, server_tls(certs, mutual=True)) as (dispatcher, _):
        # Before: "unreachable, retrying" until the test's timeout.
        with pytest.raises(ServiceUnavailableError, match="refused this reader's TLS client"):
            read_epoch(dispatcher.target, "no-client-cert")


@pytest.mark.timeout(60)
def test_an_unreachable_data_port_falls_back_to_grpc_with_one_warning(
        cluster_factory, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Also for the next epoch (a new reader): it reads gRPC from the start, without trying
    the port again or warning again (found across hosts: each epoch waited out the same
    timeouts, 15 s behind a firewall that drops)."""
    cluster = cluster_factory(1)
    closed = free_port()  # nothing listens there
    monkeypatch.setattr(transports, "data_target",
                        lambda info, target_workers: ("tcp", HOST, closed))
    attempts: list[int] = []
    connect = client._connect_tcp

    def spy(host: str, port: int) -> socket.socket:
        attempts.append(port)
        return connect(host, port)

    monkeypatch.setattr(client, "_connect_tcp", spy)
    pipeline = tds.Pipeline.range(N).apply(tds.distribute(
        "distributed_epoch", cluster.target, target_workers="ANY"))
    with caplog.at_level(logging.WARNING, logger=transports.__name__):
        assert sorted(int(x) for x in pipeline) == list(range(N))
        tried = len(attempts)
        assert tried >= transports.FALLBACK_AFTER_FAILURES
        assert sorted(int(x) for x in pipeline) == list(range(N))  # the next epoch
    assert len(attempts) == tried  # not tried again
    warnings = [r for r in caplog.records if r.name == transports.__name__]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    assert cluster.workers[0].address in message and str(closed) in message

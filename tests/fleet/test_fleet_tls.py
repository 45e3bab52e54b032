"""The fleet with TLS and a token: dispatcher on A, workers on B and C (bound to every
interface) serving gRPC and their data ports over TLS with client certificates required
(mTLS) and a shared token; a torchrun trainer on D reads a DYNAMIC epoch. Certificates are
made here by `openssl`, valid for the hosts' addresses. Readers with a wrong token, without the
CA, or without a client certificate are refused with an error that says why.

(mTLS, not TLS alone: a CLI worker trusts the dispatcher's CA only through --tls-ca /
TORCH_DATASERVICE_TLS_CA, which also makes its own server require client certificates.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.builders import OPENSSL, make_certs
from tests.fleet.helpers import METRICS_PORT, SAMPLES, assert_exactly_once, metrics, ranks
from tests.fleet.helpers import torchrun as run_trainer
from tests.fleet.hosts import Fleet, HostProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(OPENSSL is None, reason="needs the openssl command")]
TOKEN = "fleet-tls-token"
PORT, WORKER_PORT, DATA_PORT = 5100, 5101, 5102


@pytest.fixture(scope="module")
def certs(fleet: Fleet) -> Path:
    """ca.pem, and server/client certificates (both roles) for every host's address and
    name, in the fleet's shared directory."""
    cwd = fleet.shared / "certs"
    cwd.mkdir()
    names = ", ".join([f"IP:{h.address}" for h in fleet.hosts.values()]
                      + [f"DNS:{h.hostname}" for h in fleet.hosts.values()])
    return make_certs(cwd, names, ca_name="tds-fleet-ca")


def client_env(fleet: Fleet, certs: Path, token: str = TOKEN, ca: bool = True,
               cert: bool = True) -> dict[str, str]:
    env = {"TORCH_DATASERVICE_TOKEN": token, "TORCH_DATASERVICE_CONNECT_TIMEOUT_S": "5"}
    if ca:
        env["TORCH_DATASERVICE_TLS_CA"] = str(certs / "ca.pem")
    if cert:
        env["TORCH_DATASERVICE_TLS_CERT"] = str(certs / "client.pem")
        env["TORCH_DATASERVICE_TLS_KEY"] = str(certs / "client.key")
    return fleet.env(**env)


def refused(fleet: Fleet, target: str, env: dict[str, str]) -> HostProcess:
    return fleet["d"].spawn(argv=[sys.executable, "-m", "tests.fleet.client", target, "10"],
                            env=env)


@pytest.mark.timeout(200)
def test_mtls_and_token_across_hosts_and_the_refusals_say_why(fleet: Fleet,
                                                              certs: Path) -> None:
    a, b, c = fleet["a"], fleet["b"], fleet["c"]
    tls = ["--tls-cert", str(certs / "server.pem"), "--tls-key", str(certs / "server.key"),
           "--tls-ca", str(certs / "ca.pem")]
    env = fleet.env(TORCH_DATASERVICE_TOKEN=TOKEN)
    dispatcher = a.spawn("dispatcher", "--host", "0.0.0.0", "--port", str(PORT), *tls, env=env)
    workers = [host.spawn("worker", "--dispatcher", f"{a.address}:{PORT}", "--host", "0.0.0.0",
                          "--port", str(WORKER_PORT), "--data-port", str(DATA_PORT),
                          "--metrics-port", str(METRICS_PORT), "--processes", "1",
                          "--heartbeat-interval-ms", "100", *tls, env=env)
               for host in (b, c)]
    assert dispatcher.wait_serving() == f"{a.address}:{PORT}"
    assert [w.wait_serving() for w in workers] == [f"{b.address}:{WORKER_PORT}",
                                                   f"{c.address}:{WORKER_PORT}"]
    target = f"grpc://{a.address}:{PORT}"

    # The refused readers run while the trainer does (they are independent).
    wrong_token = refused(fleet, target, client_env(fleet, certs, token="not-the-token"))
    no_ca = refused(fleet, target, client_env(fleet, certs, ca=False, cert=False))
    no_cert = refused(fleet, target, client_env(fleet, certs, cert=False))

    out = fleet.shared / "tls"
    run_trainer(fleet, target, out, client_env(fleet, certs), "--modes", "pipeline",
                "--job", "tls")
    assert_exactly_once([r["pipeline"] for r in ranks(out)], SAMPLES)
    for host in (b, c):  # over the data ports, which speak TLS only
        assert metrics(fleet, host)["tcp"] > 0
    probe = fleet["d"].python(
        "import socket, ssl, sys\n"
        "from torch_dataservice.wire.data_port import ACCEPTED, HELLO, MAGIC, VERSION\n"
        "address, port, ca = sys.argv[1], int(sys.argv[2]), sys.argv[3]\n"
        "with socket.create_connection((address, port), timeout=5) as plain:\n"
        "    plain.sendall(HELLO.pack(MAGIC, VERSION, 0))\n"
        "    try:\n"
        "        print('plain', plain.recv(1) == ACCEPTED)\n"
        "    except OSError:\n"
        "        print('plain', False)\n"
        "context = ssl.create_default_context(cafile=ca)\n"
        "context.load_cert_chain(sys.argv[4], sys.argv[5])\n"
        "with context.wrap_socket(socket.create_connection((address, port), timeout=5),\n"
        "                         server_hostname=address) as tls:\n"
        "    print('tls', tls.version())\n",
        b.address, str(DATA_PORT), str(certs / "ca.pem"), str(certs / "client.pem"),
        str(certs / "client.key"))
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split("\n")[0] == "plain False"  # no element for a plaintext peer
    assert probe.stdout.split("\n")[1].startswith("tls TLSv1.")  # the cert fits B's address

    for reader in (wrong_token, no_ca, no_cert):
        assert reader.wait_exit(60) == 1, reader.output
    assert "UNAUTHENTICATED" in wrong_token.output, wrong_token.output
    assert "missing or wrong TORCH_DATASERVICE_TOKEN token" in wrong_token.output
    assert "refused a call" in dispatcher.output  # the dispatcher logs it
    assert "refused ServiceUnavailableError" in no_ca.output, no_ca.output
    assert "set TORCH_DATASERVICE_TLS_CA" in no_ca.output
    assert "refused ServiceUnavailableError" in no_cert.output, no_cert.output
    assert "TLS handshake failed" in no_cert.output and "TORCH_DATASERVICE_TLS_CERT" in (
        no_cert.output)
    assert TOKEN not in wrong_token.output + no_ca.output + no_cert.output + dispatcher.output

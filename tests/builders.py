"""Certificates for the TLS tests, made with the openssl command (tests/test_tls.py, and the
fleet's in tests/fleet/test_fleet_tls.py): a CA, and certificates it signs for both roles."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

OPENSSL = shutil.which("openssl")
LOOPBACK_NAMES = "IP:127.0.0.1, DNS:localhost"


def extensions(names: str = LOOPBACK_NAMES) -> str:
    """openssl x509 extensions for a certificate valid for `names` (subjectAltName), both roles."""
    return ("basicConstraints = CA:FALSE\nkeyUsage = digitalSignature, keyEncipherment\n"
            "extendedKeyUsage = serverAuth, clientAuth\nsubjectKeyIdentifier = hash\n"
            f"authorityKeyIdentifier = keyid\nsubjectAltName = {names}\n")


def openssl(*args: str, cwd: Path) -> None:
    assert OPENSSL is not None, "tests using certificates skip without the openssl command"
    subprocess.run([OPENSSL, *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def issue(name: str, cwd: Path) -> None:
    """`name`.pem/.key signed by ca.pem in `cwd`, with the extensions of its ext.cnf."""
    openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=cwd)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-extfile", "ext.cnf", "-out", f"{name}.pem",
            cwd=cwd)


def make_certs(cwd: Path, names: str = LOOPBACK_NAMES, ca_name: str = "tds-test-ca") -> Path:
    """ca.pem/.key, and server and client certificates valid for `names`, in `cwd`."""
    (cwd / "ext.cnf").write_text(extensions(names))
    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj",
            f"/CN={ca_name}", "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=cwd)
    issue("server", cwd)
    issue("client", cwd)
    return cwd

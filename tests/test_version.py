"""Versions: `--version`, and the handshake that refuses an incompatible worker or client.

The dispatcher runs as a subprocess so that this process (the client) and a worker can report
other versions through the test-only environment variables of torch_dataservice/version.py.
"""

from __future__ import annotations

import re
import sys

import pytest

import torch_dataservice as tds
from tests.conftest import REPO, ProcessCluster, ServerProcess, free_port
from torch_dataservice import cli, version


@pytest.mark.timeout(10)
def test_version_flag_names_package_protocol_and_python(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert f"torch-dataservice {tds.__version__}" in out
    assert f"wire protocol {version.PROTOCOL_VERSION}" in out
    assert ".".join(map(str, sys.version_info[:3])) in out


@pytest.mark.timeout(10)
def test_package_version_is_the_same_everywhere() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    (declared,) = re.findall(r'^version = "([^"]+)"', pyproject, re.MULTILINE)
    assert declared == version.PACKAGE_VERSION == tds.__version__


@pytest.mark.timeout(10)
def test_compatibility_is_protocol_and_python_minor(monkeypatch: pytest.MonkeyPatch) -> None:
    mine = version.current()
    assert mine.incompatibility(version.BuildInfo("9.9.9", mine.protocol, mine.python)) is None
    assert "protocol" in mine.incompatibility(
        version.BuildInfo(mine.package, mine.protocol + 1, mine.python))
    assert "Python" in mine.incompatibility(version.BuildInfo(mine.package, mine.protocol, "2.7"))
    monkeypatch.setenv(version.TEST_PROTOCOL_ENV, "7")
    monkeypatch.setenv(version.TEST_PYTHON_ENV, "3.99")
    assert (version.current().protocol, version.current().python) == (7, "3.99")
    monkeypatch.setenv(version.TEST_PROTOCOL_ENV, "seven")
    with pytest.raises(ValueError, match="seven"):
        version.current()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_incompatible_worker_and_client_are_refused_with_both_versions(
        process_cluster: ProcessCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    process_cluster.start_dispatcher()
    mine = version.current()
    # A worker on another wire protocol: one log line, a non-zero exit, never "serving".
    env = dict(process_cluster.env, **{version.TEST_PROTOCOL_ENV: "99"})
    worker = ServerProcess(["worker", "--dispatcher", process_cluster.dispatcher.address,
                            "--host", "127.0.0.1", "--port", str(free_port()),
                            "--processes", "0"], env)
    process_cluster.processes.append(worker)
    code = worker.wait_exit(60)
    assert code != 0, worker.output
    assert "protocol 99" in worker.output and f"protocol {mine.protocol}" in worker.output
    assert "version mismatch" in worker.output
    assert not any(line.startswith("worker serving at") for line in worker.lines)

    # A client on another Python major.minor: VersionMismatchError, a RuntimeError.
    monkeypatch.setenv(version.TEST_PYTHON_ENV, "3.1")
    pipeline = tds.Pipeline.range(4).apply(
        tds.distribute("distributed_epoch", process_cluster.target))
    with pytest.raises(tds.VersionMismatchError) as info:
        list(pipeline)
    assert isinstance(info.value, RuntimeError)
    message = str(info.value)
    assert "Python 3.1)" in message and f"Python {mine.python})" in message

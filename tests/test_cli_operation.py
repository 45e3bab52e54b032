"""The servers' operational surface: flags from the environment, common flags after the
subcommand, port files, `--dispatcher-file`, `--data-port`, advertised addresses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import torch_dataservice as tds
from tests.conftest import HOST, ProcessCluster, free_port
from torch_dataservice import cli, serving
from torch_dataservice.config import WorkerConfig
from torch_dataservice.worker.server import worker_address

SAMPLES = {"str": "x", "int": "7", "float": "2.5", "bool": "true"}
PARSED = {"str": "x", "int": 7, "float": 2.5, "bool": True}


def base_args(command: str, flag: str = "") -> list[str]:
    if command == "dispatcher" or flag in ("--dispatcher", "--dispatcher-file"):
        return [command]
    return [command, "--dispatcher", "h:1"]  # worker and status need a dispatcher


@pytest.mark.timeout(10)
def test_every_server_flag_reads_its_environment_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for command, flags in cli.FLAGS.items():
        for flag in flags:
            if flag.choices:
                sample, parsed = flag.choices[-1], flag.choices[-1]
            else:
                sample, parsed = SAMPLES[flag.kind], PARSED[flag.kind]
            with monkeypatch.context() as env:
                env.setenv(flag.env, sample)
                args = cli._parse(base_args(command, flag.name))
                assert getattr(args, flag.name[2:].replace("-", "_")) == parsed, flag.env
    # The command line wins over the environment.
    monkeypatch.setenv("TORCH_DATASERVICE_PORT", "7")
    assert cli._parse(["dispatcher", "--port", "8"]).port == 8
    assert cli._parse(["dispatcher"]).port == 7


@pytest.mark.timeout(10)
def test_a_bad_environment_value_is_a_usage_error_naming_the_variable(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TORCH_DATASERVICE_DATA_PORT", "many")
    with pytest.raises(SystemExit) as info:
        cli._parse(base_args("worker"))
    assert info.value.code == 2
    assert "TORCH_DATASERVICE_DATA_PORT='many'" in capsys.readouterr().err


@pytest.mark.timeout(10)
def test_common_flags_also_after_the_subcommand(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli._parse(["worker", "--log-level", "DEBUG", "--dispatcher", "h:1"]).log_level == (
        "DEBUG")
    assert cli._parse(["--log-level", "ERROR", "dispatcher"]).log_level == "ERROR"
    assert cli._parse(["dispatcher"]).log_level == "INFO"
    monkeypatch.setenv("TORCH_DATASERVICE_LOG_LEVEL", "WARNING")
    assert cli._parse(["dispatcher"]).log_level == "WARNING"


@pytest.mark.timeout(10)
def test_dispatcher_address_forms_and_the_dispatcher_file_deadline(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.dispatcher_address("grpc://h:5000") == "h:5000"
    assert cli.dispatcher_address("h:5000\n") == "h:5000"
    with pytest.raises(SystemExit):
        cli._parse(["worker"])  # neither --dispatcher nor --dispatcher-file
    missing = tmp_path / "never-written"
    assert cli.main(["worker", "--dispatcher-file", str(missing),
                     "--dispatcher-file-timeout-s", "0.3"]) == 2
    assert f"no dispatcher address in {missing}" in capsys.readouterr().err


@pytest.mark.timeout(10)
def test_advertised_addresses_are_never_a_wildcard() -> None:
    for wildcard in ("0.0.0.0", "::"):
        host = serving.advertised_host(wildcard, HOST)
        assert host not in ("0.0.0.0", "::", "[::]", "") and host
    assert serving.advertised_host("127.0.0.1") == "127.0.0.1"
    config = WorkerConfig("d:1", worker_address="node7:%port%")
    assert worker_address(config, 4242) == "node7:4242"
    assert not worker_address(WorkerConfig("127.0.0.1:1", host="0.0.0.0"), 5).startswith("0.0")
    with pytest.raises(ValueError, match="0.0.0.0:1"):
        WorkerConfig("d:1", worker_address="0.0.0.0:1")
    with pytest.raises(ValueError, match="drain_timeout_s"):
        WorkerConfig("d:1", drain_timeout_s=-1)


def serving_line(lines: list[str]) -> str:
    return next(line for line in lines if line.startswith("worker serving at "))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_port_files_data_port_and_environment_flags_serve_an_epoch(
        process_cluster: ProcessCluster, tmp_path: Path) -> None:
    """The Slurm pattern on loopback: the dispatcher writes its port file, workers wait for
    it; one has `%port%` in its address and its data port from the environment, one its
    flags after the subcommand and from the environment. (Tests bind loopback only: the
    wildcard's advertised address is tested above without binding it.)"""
    dispatcher_file = tmp_path / "dispatcher.addr"
    data_port = free_port()
    process_cluster.env["TORCH_DATASERVICE_DATA_PORT"] = str(data_port)
    placeholder = process_cluster.spawn(
        "worker", "--dispatcher-file", str(dispatcher_file), "--host", HOST,
        "--worker-address", f"{HOST}:%port%", "--processes", "0",
        "--port-file", str(tmp_path / "w1.addr"))
    process_cluster.env.pop("TORCH_DATASERVICE_DATA_PORT")
    process_cluster.env["TORCH_DATASERVICE_DISPATCHER_FILE"] = str(dispatcher_file)
    from_env = process_cluster.spawn("worker", "--log-level", "WARNING", "--host", HOST,
                                     "--processes", "0")
    del process_cluster.env["TORCH_DATASERVICE_DISPATCHER_FILE"]
    dispatcher = process_cluster.spawn("dispatcher", "--host", HOST, "--port", "0",
                                       "--port-file", str(dispatcher_file))
    address = dispatcher.wait_serving()
    assert dispatcher_file.read_text() == f"{address}\n"

    first = placeholder.wait_serving()
    assert re.fullmatch(rf"{HOST}:\d+", first)
    assert (tmp_path / "w1.addr").read_text() == f"{first}\n"
    port = first.rsplit(":", 1)[1]
    assert f"(gRPC port {port}, data port {data_port})" in serving_line(placeholder.lines)
    assert from_env.wait_serving().startswith(f"{HOST}:")
    assert " INFO " not in from_env.output  # --log-level after the subcommand

    pipeline = tds.Pipeline.range(40).apply(tds.distribute("distributed_epoch",
                                                           f"grpc://{address}"))
    assert sorted(pipeline) == list(range(40))

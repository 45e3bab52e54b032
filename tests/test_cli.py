"""`torch-dataservice dispatcher|worker` / `python -m torch_dataservice`: real processes."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import torch_dataservice as tds
from tests.conftest import HOST, REPO, ProcessCluster, free_port, subprocess_env, wait_until
from torch_dataservice import cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

DISPATCHER_FLAGS = ["--port", "--host", "--work-dir", "--fault-tolerant", "--worker-addresses",
                    "--worker-timeout-ms", "--job-gc-timeout-ms", "--port-file", "--log-level"]
WORKER_FLAGS = ["--dispatcher", "--port", "--host", "--worker-address", "--processes",
                "--heartbeat-interval-ms", "--data-port", "--port-file", "--dispatcher-file",
                "--drain-timeout-s", "--log-level"]


def help_text(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as info:
        cli.main([*args, "--help"])
    assert info.value.code == 0
    return capsys.readouterr().out


def subcommand_parsers() -> dict:
    parser = cli._parser()
    (commands,) = [a for a in parser._actions if a.dest == "command"]
    return dict(commands.choices)


def test_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    expected = {"dispatcher": DISPATCHER_FLAGS, "worker": WORKER_FLAGS,
                "status": ["--dispatcher", "--json", "--watch"]}
    for command, subparser in subcommand_parsers().items():
        text = help_text(capsys, command)
        for flag in expected[command]:
            assert flag in text, f"{command} --help does not mention {flag}"
        for action in subparser._actions:  # every flag the parser has, documented
            if action.option_strings and action.dest != "help":
                assert action.help, f"{command} {action.option_strings} has no help text"
                assert action.option_strings[-1] in text
    assert "SIGTERM" in help_text(capsys)


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    # (`python -m torch_dataservice` itself runs in the cluster test below.)
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2 and "usage:" in capsys.readouterr().err


@pytest.mark.integration
def test_the_console_script_entry_point() -> None:
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'torch-dataservice = "torch_dataservice.cli:main"' in pyproject
    assert callable(cli.main)
    script = shutil.which("torch-dataservice") or shutil.which(
        "torch-dataservice", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("the torch-dataservice console script is not installed")
    result = subprocess.run([script, "dispatcher", "--help"], capture_output=True, text=True,
                            timeout=60, env=subprocess_env())
    assert result.returncode == 0 and "--worker-addresses" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["dispatcher", "--fault-tolerant", "--port", "0"], "work_dir"),
    (["dispatcher", "--port", "70000"], "port"),
    (["worker", "--dispatcher", "http://localhost:5000"], "unsupported protocol 'http'"),
    (["worker", "--dispatcher", "localhost:5000", "--data-port", "70000"], "data_port"),
    (["worker", "--dispatcher", "localhost:5000", "--worker-address", "0.0.0.0:%port%"],
     "names no host"),
    (["worker", "--dispatcher", "localhost:5000", "--processes", "-1"], "num_processes"),
])
def test_bad_configurations_exit_with_an_error(capsys: pytest.CaptureFixture[str],
                                               args: list[str], message: str) -> None:
    assert cli.main(args) == 2
    assert message in capsys.readouterr().err


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a restarted server does
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        sock.listen()
        return True


def group_is_gone(pgid: int) -> bool:
    """No live process is left in the process group (zombies count as gone: here PID 1 may
    never reap orphans)."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        return False
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process just exited
        state, group = fields[0], int(fields[2])
        if group == pgid and state not in ("Z", "X"):
            return False
    return True


@pytest.mark.timeout(120)
def test_cli_servers_serve_a_job_then_stop_cleanly_on_sigterm_and_sigint(
        process_cluster: ProcessCluster) -> None:
    ports = [free_port() for _ in range(3)]
    dispatcher_address = f"{HOST}:{ports[0]}"
    # Started all at once (each imports torch): the workers wait for the dispatcher.
    dispatcher = process_cluster.spawn("dispatcher", "--host", HOST, "--port", str(ports[0]),
                                       "--worker-timeout-ms", "2000")
    workers = {
        signal.SIGTERM: process_cluster.spawn(
            "worker", "--dispatcher", dispatcher_address, "--host", HOST,
            "--port", str(ports[1]), "--processes", "1", "--heartbeat-interval-ms", "100"),
        # --processes 0 runs pipelines in threads of the worker: one interpreter less to start.
        signal.SIGINT: process_cluster.spawn(
            "worker", "--dispatcher", dispatcher_address, "--host", HOST,
            "--port", str(ports[2]), "--processes", "0", "--heartbeat-interval-ms", "100"),
    }
    assert dispatcher.wait_serving() == dispatcher_address
    assert sorted(w.wait_serving() for w in workers.values()) == sorted(
        f"{HOST}:{port}" for port in ports[1:])
    assert not any(port_is_free(port) for port in ports)

    target = f"grpc://{dispatcher_address}"
    off = tds.Pipeline.range(10).map(lambda x: x * 2).apply(
        tds.distribute("parallel_epochs", target))
    assert sorted(off) == sorted([x * 2 for x in range(10)] * 2)
    dynamic = tds.Pipeline.range(50).apply(tds.distribute("distributed_epoch", target))
    assert sorted(dynamic) == list(range(50))

    # A worker killed with SIGKILL and restarted on its port serves again (the dispatcher
    # replaces the old incarnation: still two workers' worth of data).
    killed = workers[signal.SIGINT]
    killed.kill()
    assert killed.proc.returncode == -signal.SIGKILL
    assert killed.restart() == f"{HOST}:{ports[2]}"
    assert sorted(off) == sorted([x * 2 for x in range(10)] * 2)

    # Workers first, while their dispatcher is still up; then the dispatcher.
    stops = [*workers.items(), (signal.SIGTERM, dispatcher)]
    for signum, server in stops:
        server.signal(signum)
        code = server.wait_exit(30)
        assert code == 0, f"{server.args[0]} exited with {code} on {signum.name}:\n" + (
            server.output)
    for port in ports:
        wait_until(lambda port=port: port_is_free(port), 10, f"port {port} to be free")
    for _, server in stops:  # executor processes went with their worker
        wait_until(lambda server=server: group_is_gone(server.proc.pid), 10,
                   f"{server.args[0]}'s child processes to exit")

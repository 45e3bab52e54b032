"""deploy/: what can be checked without a container engine or a cluster.

The Kubernetes manifests parse and are wired as documented (probes on the health service,
the token from a Secret, the pod IP advertised, the exposed metrics port served); every flag
and TORCH_DATASERVICE_* variable the deploy files use exists; the image pins the Makefile's
torch and serves metrics on the port it exposes; and the Slurm script's server commands run
for real on loopback and serve an epoch.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import torch_dataservice as tds
from tests.conftest import HOST, REPO, free_port, subprocess_env
from torch_dataservice import cli

DEPLOY = REPO / "deploy"
MANIFESTS = sorted((DEPLOY / "k8s").glob("*.yaml"))
SLURM_FUNCTIONS = DEPLOY / "slurm" / "tds.sh"
SBATCH = DEPLOY / "slurm" / "train.sbatch"
FLAG_RE = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def documents() -> list[dict]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def containers(kind: str) -> list[dict]:
    return [c for doc in documents() if doc["kind"] == kind
            for c in doc["spec"]["template"]["spec"]["containers"]]


def cli_flags(command: str) -> set[str]:
    (commands,) = [a for a in cli._parser()._actions if a.dest == "command"]
    return {option for action in commands.choices[command]._actions
            for option in action.option_strings}


def shell_commands(text: str) -> list[str]:
    """The logical lines of a shell script (continuations joined), comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    return [line.split(" #")[0] for line in joined.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def used_flags() -> dict[str, set[str]]:
    """command -> the flags the deploy files pass to `torch-dataservice COMMAND`."""
    used: dict[str, set[str]] = {"dispatcher": set(), "worker": set()}
    for container in containers("StatefulSet") + containers("Deployment"):
        command, *args = container["args"]
        used[command] |= {arg for arg in args if str(arg).startswith("--")}
    for line in shell_commands(SLURM_FUNCTIONS.read_text()):
        match = re.search(r"\$\{TDS_CMD:-torch-dataservice\} (dispatcher|worker)", line)
        if match:
            used[match.group(1)] |= set(FLAG_RE.findall(line[match.end():]))
    return used


@pytest.mark.timeout(30)
def test_manifests_parse_and_are_wired_as_documented() -> None:
    kinds = sorted(doc["kind"] for doc in documents())
    assert kinds == ["Deployment", "Secret", "Service", "StatefulSet"]
    (stateful,) = [d for d in documents() if d["kind"] == "StatefulSet"]
    (claim,) = stateful["spec"]["volumeClaimTemplates"]
    (dispatcher,) = containers("StatefulSet")
    (worker,) = containers("Deployment")
    (secret,) = [d for d in documents() if d["kind"] == "Secret"]
    assert {m["name"] for m in dispatcher["volumeMounts"]} == {claim["metadata"]["name"]}
    work_dir = dispatcher["args"][dispatcher["args"].index("--work-dir") + 1]
    assert work_dir == dispatcher["volumeMounts"][0]["mountPath"]
    for container in (dispatcher, worker):
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert "grpc" in ports and "metrics" in ports
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == ports["grpc"], (container["name"], probe)
        assert container["livenessProbe"]["grpc"]["service"] == "liveness"
        token = {e["name"]: e for e in container["env"]}["TORCH_DATASERVICE_TOKEN"]
        assert token["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
    env = {e["name"]: e for e in worker["env"]}
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert "$(POD_IP):%port%" in worker["args"]
    data_port = worker["args"][worker["args"].index("--data-port") + 1]
    assert {"name": "data", "containerPort": int(data_port)} in worker["ports"]
    (service,) = [d for d in documents() if d["kind"] == "Service"]
    dispatcher_arg = worker["args"][worker["args"].index("--dispatcher") + 1]
    assert dispatcher_arg.split(":")[0] == service["metadata"]["name"]


@pytest.mark.timeout(30)
def test_the_metrics_port_that_is_exposed_is_served() -> None:
    """The metrics port the manifests and the image expose is the one the servers serve
    /metrics on, and pods say where to scrape."""
    (service,) = [d for d in documents() if d["kind"] == "Service"]
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert service_ports["metrics"]["targetPort"] == "metrics"
    for kind in ("StatefulSet", "Deployment"):
        (workload,) = [d for d in documents() if d["kind"] == kind]
        (container,) = containers(kind)
        port = {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env.get("TORCH_DATASERVICE_METRICS_PORT") == str(port), container["name"]
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(port)
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    (port,) = re.findall(r"^ENV TORCH_DATASERVICE_METRICS_PORT=(\d+)$", dockerfile, re.MULTILINE)
    (exposed,) = re.findall(r"^EXPOSE (.+)$", dockerfile, re.MULTILINE)
    assert port in exposed.split()
    assert "later" not in dockerfile and "issue 11" not in "".join(
        path.read_text() for path in MANIFESTS)


@pytest.mark.timeout(30)
def test_every_flag_and_variable_the_deploy_files_use_exists() -> None:
    for command, flags in used_flags().items():
        assert flags, f"no {command} flags found: is the parsing of deploy/ stale?"
        unknown = flags - cli_flags(command)
        assert not unknown, f"deploy/ passes {sorted(unknown)} to {command}"
    flag_envs = {flag.env for flags in cli.FLAGS.values() for flag in flags} | {
        flag.env for flag in cli.COMMON}
    source = "".join(p.read_text() for p in (REPO / "torch_dataservice").rglob("*.py"))
    for path in [*MANIFESTS, SLURM_FUNCTIONS, SBATCH, DEPLOY / "Dockerfile"]:
        for name in set(re.findall(r"TORCH_DATASERVICE_[A-Z0-9_]+", path.read_text())):
            assert name in flag_envs or f'"{name}"' in source, f"{path.name}: {name}"


@pytest.mark.timeout(30)
def test_the_image_pins_the_makefiles_torch_and_runs_as_non_root() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    (pinned,) = re.findall(r"^TORCH_SPEC \?= torch==(\S+)$", (REPO / "Makefile").read_text(),
                           re.MULTILINE)
    assert re.search(rf"^ARG TORCH_VERSION={re.escape(pinned)}$", dockerfile, re.MULTILINE)
    assert re.search(r"^FROM python:3\.11-slim$", dockerfile, re.MULTILINE)
    assert "/whl/cpu" in dockerfile
    assert dockerfile.index("torch==${TORCH_VERSION}") < dockerfile.index("pip install .")
    (user,) = re.findall(r"^USER (\S+)$", dockerfile, re.MULTILINE)
    assert not user.startswith(("root", "0"))
    assert 'ENTRYPOINT ["torch-dataservice"]' in dockerfile


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_slurm_scripts_server_commands_serve_an_epoch(tmp_path: Path) -> None:
    sbatch = SBATCH.read_text()
    assert "hetjob" in sbatch and 'source "${TDS_DEPLOY_DIR}/tds.sh"' in sbatch
    for function in ("tds_dispatcher", "tds_worker", "tds_wait_dispatcher"):
        assert function in sbatch
    env = subprocess_env(
        TDS_RUN_DIR=str(tmp_path), TDS_CMD=f"{sys.executable} -m torch_dataservice",
        TDS_HOST=HOST, TDS_PORT=str(free_port()), SLURM_JOB_ID="4242",
        SLURM_CPUS_PER_TASK="1", TORCH_DATASERVICE_TOKEN="slurm-job-token")

    def step(function: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            ["bash", "-c", f"source '{SLURM_FUNCTIONS}' && {function}"], env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)

    steps = [step("tds_worker"), step("tds_dispatcher")]  # the worker waits for the file
    try:
        wait = subprocess.run(["bash", "-c", f"source '{SLURM_FUNCTIONS}' && "
                               "tds_wait_dispatcher 60"], env=env, capture_output=True,
                              text=True, timeout=70)
        assert wait.returncode == 0, wait.stderr
        target = wait.stdout.strip()
        assert target == f"grpc://{HOST}:{env['TDS_PORT']}"
        assert (tmp_path / "journal").is_dir()  # --fault-tolerant --work-dir in the run dir
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("TORCH_DATASERVICE_TOKEN", "slurm-job-token")
            pipeline = tds.Pipeline.range(30).apply(tds.distribute("distributed_epoch", target))
            assert sorted(pipeline) == list(range(30))
        for process in steps:  # workers drain on SIGTERM, then the dispatcher stops
            process.send_signal(signal.SIGTERM)
            output, _ = process.communicate(timeout=40)
            assert process.returncode == 0, output
    finally:
        for process in steps:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)

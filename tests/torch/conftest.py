"""One in-process cluster (a dispatcher and one worker with one executor process) shared by the
tests of tds.DataLoader: each loader's epochs are anonymous jobs of their own, so tests cannot
see each other's batches, and the executor process starts once."""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import HOST, Cluster, _make_cluster, free_port


@pytest.fixture(scope="package")
def cluster() -> Iterator[Cluster]:
    made = _make_cluster(1, num_processes=1)
    yield made
    made.stop()


FIDELITY_MODULES = [f"tests.torch.test_fidelity_{name}" for name in (
    "workers", "randomness", "continue", "lifecycle", "warnings", "resume")]


@pytest.fixture(scope="package", autouse=True)
def _torch_workers_not_forked() -> Iterator[None]:
    """torch's own DataLoader, the reference of many tests here, forks its workers by default:
    forking this process, which runs gRPC servers and clients on threads, can crash the child
    (gRPC is not fork-safe). Its workers start from a forkserver instead, which has imported
    torch and the test modules once, so that starting one costs a fork, not an import."""
    previous = multiprocessing.get_start_method(allow_none=True)
    multiprocessing.set_start_method("forkserver", force=True)
    multiprocessing.set_forkserver_preload(["torch", "numpy", "tests.torch.builders",
                                           *FIDELITY_MODULES])
    yield
    multiprocessing.set_start_method(previous, force=True)


def launch(ranks: int, script: Path, *torchrun_args: str) -> tuple[list[str], dict[str, str]]:
    """The command (and its environment) that runs `script` as `ranks` ranks: torchrun, or
    for one rank the script alone with torchrun's variables, as one-GPU training starts (a
    torchrun agent is one more process importing torch: the torchrun tests pay per process)."""
    if ranks > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={ranks}", *torchrun_args, str(script)], {}
    if torchrun_args:
        raise ValueError(f"torchrun arguments {torchrun_args!r} given for a single rank")
    return [sys.executable, str(script)], {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": HOST, "MASTER_PORT": str(free_port())}

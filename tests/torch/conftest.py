"""One in-process cluster (a dispatcher and one worker with one executor process) shared by the
tests of tds.DataLoader: each loader's epochs are anonymous jobs of their own, so tests cannot
see each other's batches, and the executor process starts once."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator

import pytest

from tests.conftest import Cluster, _make_cluster


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
    multiprocessing.set_forkserver_preload(["torch", "numpy", *FIDELITY_MODULES])
    yield
    multiprocessing.set_start_method(previous, force=True)

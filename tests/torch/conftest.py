"""One in-process cluster (a dispatcher and one worker with one executor process) shared by the
tests of tds.DataLoader: each loader's epochs are anonymous jobs of their own, so tests cannot
see each other's batches, and the executor process starts once."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conftest import Cluster, _make_cluster


@pytest.fixture(scope="package")
def cluster() -> Iterator[Cluster]:
    made = _make_cluster(1, num_processes=1)
    yield made
    made.stop()

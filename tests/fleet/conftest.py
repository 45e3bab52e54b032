"""The fleet fixture: hosts a..e on one switch (tests/fleet/hosts.py), torn down at the end of
the module whatever happened. Building it needs root and iproute2: without them the tests
fail with the reason (they must never pass silently by skipping)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from tests.fleet.hosts import Fleet, FleetError

HOSTS = ("a", "b", "c", "d", "e")


@contextlib.contextmanager
def started_fleet(names: tuple[str, ...]) -> Iterator[Fleet]:
    """Hosts `names` on one switch, torn down on leaving; the test fails if they cannot be
    built."""
    hosts = Fleet(names)
    try:
        hosts.start()
    except FleetError as error:
        pytest.fail(f"cannot build the fleet of network namespaces: {error}", pytrace=False)
    try:
        yield hosts
    finally:
        hosts.close()


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with started_fleet(HOSTS) as hosts:
        yield hosts

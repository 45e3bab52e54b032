"""The fleet fixture: hosts a..e on one switch (tests/fleet/hosts.py), torn down at the end of
the module whatever happened. Building it needs root and iproute2: without them the tests
fail with the reason (they must never pass silently by skipping)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.fleet.hosts import Fleet, FleetError

HOSTS = ("a", "b", "c", "d", "e")


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    hosts = Fleet(HOSTS)
    try:
        hosts.start()
    except FleetError as error:
        pytest.fail(f"cannot build the fleet of network namespaces: {error}", pytrace=False)
    try:
        yield hosts
    finally:
        hosts.close()

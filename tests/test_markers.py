"""The `integration` marker keeps its promise (tests/conftest.py): a test without it cannot start a
server or a process, and a test using a server fixture gets it without asking."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
from types import SimpleNamespace

import grpc
import pytest

from tests import conftest

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("start", [
    lambda: grpc.server(None),
    lambda: subprocess.run([sys.executable, "-c", "pass"], check=True),
    lambda: multiprocessing.get_context("spawn").Process(target=int).start(),
])
def test_a_test_without_the_marker_cannot_start_a_server_or_a_process(start) -> None:
    with pytest.raises(pytest.fail.Exception, match="not marked integration"):
        start()


@pytest.mark.integration
def test_a_marked_test_may_start_a_process() -> None:
    subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=20)


def test_a_test_using_a_server_fixture_is_marked_integration() -> None:
    marks: list[pytest.MarkDecorator] = []
    uses = SimpleNamespace(fixturenames=["tmp_path", "cluster_factory"], add_marker=marks.append,
                           nodeid="tests/test_x.py::test_a")
    does_not = SimpleNamespace(fixturenames=["tmp_path"], add_marker=marks.append,
                               nodeid="tests/test_x.py::test_b")
    conftest.pytest_collection_modifyitems([uses, does_not])  # type: ignore[list-item]
    assert [mark.name for mark in marks if mark.name != "xdist_group"] == ["integration"]


def test_a_module_and_the_fleet_tests_each_run_in_one_process() -> None:
    """`make test` runs two processes (pytest-xdist, --dist loadgroup): a module's tests share
    one (its module-scoped clusters start once), and all fleet tests one (memory)."""
    marks: list[pytest.MarkDecorator] = []
    items = [SimpleNamespace(fixturenames=[], add_marker=marks.append, nodeid=nodeid)
             for nodeid in ("tests/a/test_x.py::test_one", "tests/a/test_x.py::test_two[1]",
                            "tests/fleet/test_fleet.py::test_t", "tests/fleet/test_h.py::t")]
    conftest.pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [mark.args for mark in marks if mark.name == "xdist_group"] == [
        ("tests/a/test_x.py",), ("tests/a/test_x.py",), ("fleet",), ("fleet",)]
    # The fleet's long group goes first, each group's tests in their order.
    assert [item.nodeid for item in items] == [
        "tests/fleet/test_fleet.py::test_t", "tests/fleet/test_h.py::t",
        "tests/a/test_x.py::test_one", "tests/a/test_x.py::test_two[1]"]

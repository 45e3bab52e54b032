"""The `integration` marker keeps its promise (tests/conftest.py): a test without it cannot start a
server or a process, and a test using a server fixture gets it without asking."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from tests import conftest

REPO = Path(__file__).resolve().parents[1]

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
                           nodeid="tests/test_x.py::test_a", get_closest_marker=lambda name: None)
    does_not = SimpleNamespace(fixturenames=["tmp_path"], add_marker=marks.append,
                               nodeid="tests/test_x.py::test_b",
                               get_closest_marker=lambda name: None)
    conftest.pytest_collection_modifyitems([uses, does_not])  # type: ignore[list-item]
    assert [mark.name for mark in marks] == ["integration"]


def test_the_fleet_then_the_fault_tests_go_first_each_groups_tests_in_their_order() -> None:
    """Then the modules with a slow test (all of a module's tests together), then the rest."""
    def item(nodeid: str, slow: bool = False) -> SimpleNamespace:
        def marker(name: str) -> pytest.MarkDecorator | None:
            return pytest.mark.slow if slow and name == "slow" else None

        return SimpleNamespace(fixturenames=[], add_marker=lambda mark: None, nodeid=nodeid,
                               get_closest_marker=marker)

    items = [item("tests/a/test_x.py::test_one"), item("tests/b/test_s.py::test_quick"),
             item("tests/fault/test_k.py::test_k"), item("tests/a/test_x.py::test_two[1]"),
             item("tests/b/test_s.py::test_slow", slow=True),
             item("tests/fleet/test_fleet.py::test_t"), item("tests/fleet/test_h.py::t")]
    conftest.pytest_collection_modifyitems(items)  # type: ignore[arg-type]
    assert [conftest.run_group(item.nodeid) for item in items] == [
        "fleet", "fleet", "tests/fault/test_k.py", "tests/b/test_s.py", "tests/b/test_s.py",
        "tests/a/test_x.py", "tests/a/test_x.py"]
    assert [item.nodeid for item in items] == [
        "tests/fleet/test_fleet.py::test_t", "tests/fleet/test_h.py::t",
        "tests/fault/test_k.py::test_k",
        "tests/b/test_s.py::test_quick", "tests/b/test_s.py::test_slow",
        "tests/a/test_x.py::test_one", "tests/a/test_x.py::test_two[1]"]


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_module_and_the_fleet_tests_each_run_in_one_process(tmp_path: Path) -> None:
    """`make test` runs two processes (pytest-xdist, --dist loadscope): a module's tests share
    one (its module-scoped clusters start once), and all fleet tests one (memory). Run for
    real on a small tree scheduled by tests/conftest.py's hook."""
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(REPO)!r})\n"
        "from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n"
        "from tests.conftest import pytest_xdist_make_scheduler  # noqa: F401\n")
    test = ("import os, time\n"
            "def record(name):\n"
            "    time.sleep(0.2)  # long enough for the other process to take work\n"
            "    with open(os.environ['RECORDS'], 'a') as f:\n"
            "        f.write(f\"{__name__}.{name} {os.environ['PYTEST_XDIST_WORKER']}\\n\")\n"
            + "".join(f"def test_{i}():\n    record({i})\n" for i in range(4)))
    for module in ("tests/fleet/test_f1.py", "tests/fleet/test_f2.py", "tests/a/test_x.py",
                   "tests/a/test_y.py"):
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).write_text(test)
    records = tmp_path / "records"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadscope",
         "-p", "no:cacheprovider", "-p", "no:randomly", "--rootdir", str(tmp_path),
         "tests"], cwd=tmp_path, capture_output=True, text=True, timeout=100,
        env=dict(os.environ, RECORDS=str(records)))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    ran: dict[str, set[str]] = {}
    for line in records.read_text().splitlines():
        test, worker = line.split()
        module = test.rsplit(".", 1)[0].rsplit(".", 1)[-1]
        ran.setdefault("fleet" if module.startswith("test_f") else module, set()).add(worker)
    assert sum(1 for _ in records.read_text().splitlines()) == 16
    assert all(len(workers) == 1 for workers in ran.values()), ran  # one process per group
    assert set(ran) == {"fleet", "test_x", "test_y"}

"""benchmarks/_common.py: the servers a benchmark starts run the checkout it belongs to."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(60)
def test_a_spawned_server_runs_this_checkout_whatever_the_working_directory(
        tmp_path: Path, monkeypatch) -> None:
    # `python -m` imports from the working directory first: a before/after benchmark of two
    # checkouts, run from one of them, timed that one twice.
    other = tmp_path / "torch_dataservice"
    other.mkdir()
    (other / "__init__.py").write_text("")
    (other / "__main__.py").write_text("print('dispatcher serving at grpc://other-checkout:1')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    sys.modules.pop("_common", None)
    import _common

    proc, address = _common.spawn_server(["dispatcher", "--host", "127.0.0.1", "--port", "0"])
    try:
        assert address != "other-checkout:1" and address.startswith("127.0.0.1:")
    finally:
        _common.stop_servers([proc])

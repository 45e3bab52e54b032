"""The Grafana dashboard under deploy/ queries only metrics the servers and trainers export."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import REPO

EXPORTED = {
    "tds_client_wait_seconds_total", "tds_client_batches_total", "tds_worker_elements_total",
    "tds_worker_bytes_sent_total", "tds_worker_stage_seconds_total",
    "tds_dispatcher_optimal_workers", "tds_dispatcher_workers",
    "tds_dispatcher_rpc_seconds_bucket", "tds_worker_buffered_elements",
}


@pytest.mark.timeout(10)
def test_dashboard_panels_query_exported_metrics() -> None:
    dashboard = json.loads((REPO / "deploy" / "grafana" / "torch_dataservice.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\btds_\w+", expr)}
    assert used <= EXPORTED, used - EXPORTED
    assert {"tds_client_wait_seconds_total", "tds_client_batches_total",
            "tds_worker_stage_seconds_total", "tds_dispatcher_optimal_workers"} <= used
    guide = (REPO / "docs" / "operations.md").read_text()
    assert "Is my trainer starved?" in guide and exprs[0].split(" / ")[0].split("[")[0] in guide

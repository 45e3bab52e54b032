"""The data port's connect timeout: 5 s, or what TORCH_DATASERVICE_DATA_PORT_TIMEOUT_S says."""

from __future__ import annotations

import pytest

from torch_dataservice.client import data_port

pytestmark = pytest.mark.timeout(30)


def test_the_connect_timeout_comes_from_the_environment(monkeypatch) -> None:
    monkeypatch.delenv(data_port.CONNECT_TIMEOUT_ENV, raising=False)
    assert data_port.connect_timeout_s() == data_port.CONNECT_TIMEOUT_S
    monkeypatch.setenv(data_port.CONNECT_TIMEOUT_ENV, "0.5")
    assert data_port.connect_timeout_s() == 0.5
    for bad in ("0", "-1", "soon"):
        monkeypatch.setenv(data_port.CONNECT_TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=f"TORCH_DATASERVICE_DATA_PORT_TIMEOUT_S.*{bad!r}"):
            data_port.connect_timeout_s()


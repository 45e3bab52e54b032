"""DispatcherConfig / WorkerConfig: validated where they are built, errors name the bad value."""

from __future__ import annotations

import pytest

import torch_dataservice as tds


def test_dispatcher_defaults() -> None:
    config = tds.DispatcherConfig()
    assert (config.port, config.protocol, config.host) == (0, "grpc", "localhost")
    assert config.work_dir is None and not config.fault_tolerant_mode
    assert config.worker_addresses is None
    assert config.effective_worker_timeout_ms > 0
    assert config.effective_job_gc_timeout_ms > 0 and config.effective_job_gc_check_interval_ms > 0


def test_fault_tolerant_mode_requires_a_work_dir(tmp_path) -> None:
    with pytest.raises(ValueError, match="work_dir"):
        tds.DispatcherConfig(fault_tolerant_mode=True)
    with pytest.raises(ValueError, match="work_dir"):
        tds.DispatcherConfig(fault_tolerant_mode=True, work_dir="")
    config = tds.DispatcherConfig(fault_tolerant_mode=True, work_dir=str(tmp_path))
    assert config.work_dir == str(tmp_path)


@pytest.mark.parametrize("port", [-1, 65536, "5000", 1.5, None])
def test_bad_ports_are_rejected(port: object) -> None:
    with pytest.raises(ValueError, match="port"):
        tds.DispatcherConfig(port=port)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="port"):
        tds.WorkerConfig("localhost:5000", port=port)  # type: ignore[arg-type]


def test_good_ports_are_kept() -> None:
    assert tds.DispatcherConfig(port=65535).port == 65535
    assert tds.WorkerConfig("localhost:5000", port=0).port == 0


def test_only_grpc_is_a_protocol() -> None:
    with pytest.raises(ValueError, match="'http'"):
        tds.DispatcherConfig(protocol="http")
    with pytest.raises(ValueError, match="'http'"):
        tds.WorkerConfig("localhost:5000", protocol="http")


@pytest.mark.parametrize("addresses", [[], ["a:1", ""], ["a:1", "a:1"], [3]])
def test_bad_worker_address_lists(addresses: list) -> None:
    with pytest.raises(ValueError, match="worker_addresses"):
        tds.DispatcherConfig(worker_addresses=addresses)


def test_worker_addresses_are_copied_to_a_list() -> None:
    addresses = ("a:1", "b:2")
    config = tds.DispatcherConfig(worker_addresses=addresses)  # type: ignore[arg-type]
    assert config.worker_addresses == ["a:1", "b:2"]


@pytest.mark.parametrize("name", ["job_gc_check_interval_ms", "job_gc_timeout_ms",
                                  "worker_timeout_ms"])
@pytest.mark.parametrize("value", [0, -5, 1.5, "10"])
def test_dispatcher_durations_must_be_positive_ms(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        tds.DispatcherConfig(**{name: value})


def test_dispatcher_durations_override_the_defaults() -> None:
    config = tds.DispatcherConfig(worker_timeout_ms=250, job_gc_timeout_ms=1000,
                                  job_gc_check_interval_ms=50)
    assert config.effective_worker_timeout_ms == 250
    assert config.effective_job_gc_timeout_ms == 1000
    assert config.effective_job_gc_check_interval_ms == 50


@pytest.mark.parametrize("address", ["", "grpc://localhost:5000", None, 5000])
def test_worker_needs_a_plain_dispatcher_address(address: object) -> None:
    with pytest.raises(ValueError, match="dispatcher_address"):
        tds.WorkerConfig(address)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["heartbeat_interval_ms", "dispatcher_timeout_ms"])
def test_worker_durations_must_be_positive_ms(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        tds.WorkerConfig("localhost:5000", **{name: 0})


@pytest.mark.parametrize("value", [-1, 1.0, "2"])
def test_num_processes_must_be_a_non_negative_int(value: object) -> None:
    with pytest.raises(ValueError, match="num_processes"):
        tds.WorkerConfig("localhost:5000", num_processes=value)  # type: ignore[arg-type]


def test_worker_defaults_and_overrides() -> None:
    config = tds.WorkerConfig("localhost:5000")
    assert config.worker_address is None and config.host == "localhost"
    assert config.effective_num_processes >= 1
    assert config.effective_heartbeat_interval_ms > 0
    assert tds.WorkerConfig("localhost:5000", num_processes=0).effective_num_processes == 0
    assert tds.WorkerConfig("h:1", heartbeat_interval_ms=30).effective_heartbeat_interval_ms == 30


def test_cross_trainer_cache_bytes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="cross_trainer_cache_bytes"):
        tds.WorkerConfig("localhost:5000", cross_trainer_cache_bytes=0)


@pytest.mark.parametrize("value", [-1, 1.5, "4", None])
def test_split_prefetch_must_be_a_non_negative_int(value: object) -> None:
    with pytest.raises(ValueError, match=f"split_prefetch must be an int >= 0, got {value!r}"):
        tds.WorkerConfig("localhost:5000", split_prefetch=value)  # type: ignore[arg-type]


def test_split_prefetch_zero_is_allowed() -> None:
    assert tds.WorkerConfig("localhost:5000", split_prefetch=0).split_prefetch == 0

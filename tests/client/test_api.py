"""The reading API's argument checks: ValueError naming the bad value, before any contact.

Every call here points at an address where nothing listens: had the client tried to reach the
service it would have retried until the connect deadline and raised a connection error instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

import torch_dataservice as tds
from tests.conftest import free_port
from torch_dataservice.errors import ServiceUnavailableError
from torch_dataservice.rpc import parse_service

pytestmark = pytest.mark.timeout(60)

FAST_S = 2.0  # validation is local: far below the connect deadline


@pytest.fixture
def dead_target(fast_connect_failure: None) -> str:
    return f"grpc://127.0.0.1:{free_port()}"


def raises_fast(call: Callable[[], Any], match: str) -> None:
    start = time.monotonic()
    with pytest.raises(ValueError, match=match):
        call()
    assert time.monotonic() - start < FAST_S


def reader_calls(target: str) -> list[Callable[..., Any]]:
    """distribute and from_dataset_id, each with `**kwargs` of the arguments they share."""
    return [
        lambda **kw: tds.distribute(kw.pop("processing_mode", "distributed_epoch"),
                                    kw.pop("service", target), **kw),
        lambda **kw: tds.from_dataset_id(kw.pop("processing_mode", "distributed_epoch"),
                                         kw.pop("service", target), "1000", **kw),
    ]


@pytest.mark.parametrize("which", [0, 1], ids=["distribute", "from_dataset_id"])
@pytest.mark.parametrize("kwargs, match", [
    (dict(consumer_index=0), r"consumer_index=0, num_consumers=None"),
    (dict(num_consumers=2, job_name="j"), r"consumer_index=None, num_consumers=2"),
    (dict(consumer_index=0, num_consumers=2), r"num_consumers=2 needs a job_name"),
    (dict(job_name=""), r"job_name .*''"),
    (dict(job_name=3), r"job_name .*3"),
    (dict(consumer_index=2, num_consumers=2, job_name="j"), r"consumer_index .*2"),
    (dict(consumer_index=0, num_consumers=0, job_name="j"), r"num_consumers .*0"),
    (dict(max_outstanding_requests=0), r"max_outstanding_requests .*0"),
    (dict(target_workers="SOME"), r"target_workers .*'SOME'"),
    (dict(cross_trainer_cache="t"), r"cross_trainer_cache"),
    (dict(cross_trainer_cache=tds.CrossTrainerCache("t")), r"cross_trainer_cache needs a job"),
    (dict(processing_mode="sharded"), r"'sharded'.*'parallel_epochs'.*'distributed_epoch'"),
    (dict(processing_mode=9), r"processing_mode 9"),
    (dict(service="grpc://a:1://b"), r"'grpc://a:1://b'"),
    (dict(service=""), r"service must not be empty"),
    (dict(service="http://a:1"), r"'http'"),
    (dict(service=("grpc",)), r"\('grpc',\)"),
])
def test_reader_argument_errors_raise_before_contact(
        dead_target: str, which: int, kwargs: dict, match: str) -> None:
    call = reader_calls(dead_target)[which]
    raises_fast(lambda: call(**kwargs), match)


@pytest.mark.parametrize("compression", ["snappy", "", "auto", 0])
def test_unknown_compression_raises_before_contact(dead_target: str, compression: Any) -> None:
    raises_fast(lambda: tds.distribute("parallel_epochs", dead_target, compression=compression),
                f"compression .*{compression!r}")
    raises_fast(lambda: tds.register_dataset(dead_target, tds.Pipeline.range(3),
                                             compression=compression),
                f"compression .*{compression!r}")


def test_register_dataset_argument_errors(dead_target: str) -> None:
    raises_fast(lambda: tds.register_dataset(dead_target, [1, 2, 3]), "Pipeline")
    raises_fast(lambda: tds.register_dataset(dead_target, tds.Pipeline.range(3), dataset_id=""),
                "dataset_id .*''")
    raises_fast(lambda: tds.register_dataset("a://b://c", tds.Pipeline.range(3)), "a://b://c")
    raises_fast(lambda: tds.from_dataset_id("parallel_epochs", dead_target, ""),
                "dataset_id .*''")


def test_cross_trainer_cache_needs_a_trainer_id() -> None:
    with pytest.raises(ValueError, match="trainer_id .*''"):
        tds.CrossTrainerCache("")
    assert tds.CrossTrainerCache("trainer-a").trainer_id == "trainer-a"


def test_processing_modes_and_policies() -> None:
    assert [p.name for p in tds.ShardingPolicy] == [
        "OFF", "DYNAMIC", "FILE", "DATA", "FILE_OR_DATA", "HINT"]
    assert [int(p) for p in tds.ShardingPolicy] == [0, 1, 2, 3, 4, 5]
    # Valid modes build a reader without contacting the service.
    for mode in ("parallel_epochs", "distributed_epoch", tds.ShardingPolicy.DATA, 5):
        tds.from_dataset_id(mode, "127.0.0.1:1", "1000")


def test_service_forms() -> None:
    assert parse_service("grpc://h:1") == ("grpc", "h:1")
    assert parse_service("h:1") == ("grpc", "h:1")
    assert parse_service(("grpc", "h:1")) == ("grpc", "h:1")
    with pytest.raises(ValueError, match="empty address"):
        parse_service("grpc://")


@pytest.mark.timeout(30)
def test_registering_where_nothing_listens_fails_clearly(dead_target: str) -> None:
    start = time.monotonic()
    with pytest.raises(ServiceUnavailableError, match="registering a dataset") as info:
        tds.register_dataset(dead_target, tds.Pipeline.range(3))
    assert isinstance(info.value, ConnectionError)
    assert dead_target.removeprefix("grpc://") in str(info.value)
    assert time.monotonic() - start < 1 + 10  # the connect deadline (1 s) plus slack


@pytest.mark.timeout(30)
def test_reading_where_nothing_listens_fails_clearly(dead_target: str) -> None:
    pipeline = tds.from_dataset_id("parallel_epochs", dead_target, "1000")
    start = time.monotonic()
    with pytest.raises(ConnectionError):
        list(pipeline)
    assert time.monotonic() - start < 1 + 10

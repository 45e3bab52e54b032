"""The shared token: checked on every RPC; no unauthenticated server beyond loopback."""

from __future__ import annotations

import grpc
import pytest

import torch_dataservice as tds
from torch_dataservice import auth
from torch_dataservice.proto import dispatcher_pb2


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "127.3.4.5", "::1", "[::1]"])
def test_loopback_hosts_need_no_token(host: str, monkeypatch) -> None:
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    auth.check_bind(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "myhost.example", "::"])
def test_network_hosts_without_a_token_are_refused(host: str, monkeypatch) -> None:
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    monkeypatch.delenv(auth.ALLOW_UNAUTHENTICATED_ENV, raising=False)
    with pytest.raises(ValueError, match="without authentication"):
        auth.check_bind(host)
    monkeypatch.setenv(auth.TOKEN_ENV, "s3cret")
    auth.check_bind(host)  # a token makes it acceptable


def test_worker_refuses_a_network_host_before_starting_executors(monkeypatch) -> None:
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    monkeypatch.delenv(auth.ALLOW_UNAUTHENTICATED_ENV, raising=False)
    worker = tds.WorkerServer(
        tds.WorkerConfig("127.0.0.1:1", host="0.0.0.0", num_processes=0), start=False)
    with pytest.raises(ValueError, match="0.0.0.0"):
        worker.start()
    assert worker._tasks is None  # noqa: SLF001 - nothing was started


def _raw_heartbeat(address: str, metadata: list[tuple[str, str]]) -> grpc.RpcError | None:
    channel = grpc.insecure_channel(address)
    try:
        channel.unary_unary(
            "/torch_dataservice.v1.DispatcherService/ClientHeartbeat",
            request_serializer=dispatcher_pb2.ClientHeartbeatRequest.SerializeToString,
            response_deserializer=dispatcher_pb2.ClientHeartbeatResponse.FromString,
        )(dispatcher_pb2.ClientHeartbeatRequest(client_id=1), metadata=metadata, timeout=5)
    except grpc.RpcError as error:
        return error
    finally:
        channel.close()
    return None


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_with_a_token_every_call_must_carry_it(monkeypatch) -> None:
    monkeypatch.setenv(auth.TOKEN_ENV, "s3cret")
    with tds.DispatchServer(tds.DispatcherConfig(host="127.0.0.1")) as dispatcher, \
            tds.WorkerServer(tds.WorkerConfig(dispatcher.address, host="127.0.0.1",
                                              num_processes=0)):
        # Our own clients attach the token: the service works end to end (ANY: the worker is
        # read over gRPC too, not in-process).
        pipeline = tds.Pipeline.range(6).apply(
            tds.distribute("distributed_epoch", dispatcher.target, target_workers="ANY"))
        assert sorted(pipeline) == list(range(6))
        # A caller without it, or with a wrong one, is refused before any handler runs.
        for metadata in ([], [(auth.METADATA_KEY, "wrong")]):
            error = _raw_heartbeat(dispatcher.address, metadata)
            assert error is not None and error.code() == grpc.StatusCode.UNAUTHENTICATED
        # With the right token the call reaches the handler (which says the client is unknown).
        error = _raw_heartbeat(dispatcher.address, [(auth.METADATA_KEY, "s3cret")])
        assert error is not None and error.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.timeout(60)
def test_a_channel_made_before_the_token_was_set_is_not_reused(monkeypatch) -> None:
    """Channels are shared per address: one made without a token (an earlier server on a
    reused port) must not be handed out once the token is set."""
    from torch_dataservice.rpc import channel_to

    address = "127.0.0.1:1"
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    plain = channel_to(address)
    monkeypatch.setenv(auth.TOKEN_ENV, "s3cret")
    assert channel_to(address) is not plain
    assert channel_to(address) is channel_to(address)

"""Every DispatcherService handler that applies a change is `durable`: it syncs the journal
before its reply leaves. Read from the service's source, so a new handler cannot forget it."""

from __future__ import annotations

import ast
import inspect

from torch_dataservice.dispatcher import service


def _methods() -> dict[str, ast.FunctionDef]:
    tree = ast.parse(inspect.getsource(service.DispatcherService))
    cls = tree.body[0]
    assert isinstance(cls, ast.ClassDef)
    return {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}


def _self_calls(method: ast.FunctionDef) -> set[str]:
    """Names `n` of the `self.n(...)` and `self.n.m(...)` calls in `method`."""
    names = set()
    for node in ast.walk(method):
        if not isinstance(node, ast.Call):
            continue
        target = node.func
        while isinstance(target, ast.Attribute):
            if isinstance(target.value, ast.Name) and target.value.id == "self":
                names.add(target.attr)
                break
            target = target.value
    return names


def _applying(methods: dict[str, ast.FunctionDef]) -> set[str]:
    """Methods that apply a change: they call `self._apply`, an `Effects` step (each applies
    through the same `_apply`), or another method that does."""
    applying = {"_apply", "_effects"}
    grown = True
    while grown:
        grown = False
        for name, method in methods.items():
            if name not in applying and _self_calls(method) & applying:
                applying.add(name)
                grown = True
    return applying - {"_apply", "_effects", "__init__"}


def _decorators(method: ast.FunctionDef) -> set[str]:
    return {d.id if isinstance(d, ast.Name) else ast.unparse(d) for d in method.decorator_list}


def test_every_handler_that_applies_a_change_is_durable() -> None:
    methods = _methods()
    handlers = {name for name in _applying(methods) if name[0].isupper()}
    assert {"GetOrCreateIteration", "ClientHeartbeat", "WorkerHeartbeat", "GetSplit"} <= handlers
    not_durable = sorted(name for name in handlers if "durable" not in _decorators(methods[name]))
    assert not not_durable, f"handlers that apply a change but are not @durable: {not_durable}"


def test_durable_is_the_journal_s_decorator() -> None:
    from torch_dataservice.dispatcher import journal

    assert service.durable is journal.durable


def test_a_request_is_timed_from_its_arrival_in_the_handler_queue() -> None:
    """tds_dispatcher_rpc_seconds counts the wait for a handler thread too: past capacity
    that wait is most of a request's latency, and a handler's own time alone would hide it."""
    import threading
    import time
    from types import SimpleNamespace

    from torch_dataservice.dispatcher import cadence, journal, observe

    observer = observe.DispatcherObserver(with_metrics=True)
    host = SimpleNamespace(_cadence=cadence.Cadence(budget_rps=100, max_pending=8),
                           _journal=journal.NullJournal(), _observe=observer)

    @journal.durable
    def GetSplit(self, request, context):  # noqa: N802 - as gRPC names it
        return "reply"

    def handled_after_waiting(queued_s: float) -> None:
        cadence._queued.at = time.monotonic() - queued_s  # as QueuedExecutor notes it
        assert GetSplit(host, None, None) == "reply"

    thread = threading.Thread(target=handled_after_waiting, args=(0.5,))
    thread.start()
    thread.join(10)
    total = observer.registry.get_sample_value("tds_dispatcher_rpc_seconds_sum",
                                               {"method": "GetSplit"})
    assert total is not None and total >= 0.5

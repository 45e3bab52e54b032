"""Workers running in this process, by address: in-process readers skip gRPC for them."""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

_lock = threading.Lock()
_workers: dict[str, Any] = {}

HOST_ID = socket.gethostname()


def process_id() -> str:
    return f"{HOST_ID}:{os.getpid()}"


def register(address: str, service: Any) -> None:
    with _lock:
        _workers[address] = service


def unregister(address: str) -> None:
    with _lock:
        _workers.pop(address, None)


def lookup(address: str) -> Any | None:
    with _lock:
        return _workers.get(address)

"""What stays inside this process, shared by the worker and the reader (the contract floor):
this host's and process's identity, workers by address (in-process readers skip gRPC for them),
and elements made by pipeline threads of this process, handed over as objects.

With `WorkerConfig(num_processes=0)` a worker runs its pipelines on threads of this process.
Their elements then travel to the task buffer as `LocalElement`s through a `LocalChannel`, not
encoded: an in-process reader receives the very object the pipeline produced (no encode, no
copy, no decode, as tf.data service's same-process LOCAL reads and torch's DataLoader with
`num_workers=0`); only a reader elsewhere (data port, gRPC) or the cross-trainer cache makes
the element encode itself, once.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

from torch_dataservice.wire import codec

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


class LocalElement:
    """An element of a pipeline thread of this process, kept as the object it is.

    `size` is an estimate of its encoded bytes (codec.estimate_size): credits and fetch sizes
    count it instead of a payload's length, so memory stays bounded as for encoded elements.
    `take()` hands the object itself to an in-process reader: it is not copied, so the reader
    and the pipeline share it (the pipeline must not change an element after yielding it).
    `encoded()` makes the payload a remote reader needs, with the job's compression; it is
    made once and the object dropped then, so a reader afterwards gets a decoded copy.
    Each buffered element goes to one reader (the cross-trainer cache, which serves one to
    several trainers, encodes it first), so an object is never handed to two readers.
    """

    __slots__ = ("_compression", "_element", "_encoded", "_lock", "size")

    def __init__(self, element: Any, compression: str | None, size: int) -> None:
        self._element = element
        self._compression = compression
        self._encoded: bytes | None = None
        self._lock = threading.Lock()
        self.size = size

    def take(self) -> Any:
        """The element for an in-process reader: the object itself, unless it was encoded."""
        with self._lock:
            if self._encoded is None:
                return self._element
            encoded = self._encoded
        return codec.decode(encoded)

    def encoded(self) -> bytes:
        """The element's payload (encoded on the first call, by the calling thread)."""
        with self._lock:
            if self._encoded is None:
                self._encoded = b"".join(codec.encode(self._element, self._compression))
                self._element = None  # the payload holds copies of its tensors' bytes
            return self._encoded


def payload_nbytes(payload: Any) -> int:
    """Bytes a buffered payload counts for (an encoded payload's length, or the estimate)."""
    if type(payload) is LocalElement:
        return payload.size
    nbytes = getattr(payload, "nbytes", None)  # arrays, memoryviews, shm.PiecedPayload
    return len(payload) if nbytes is None else nbytes  # bytes, bytearray

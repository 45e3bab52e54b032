"""Where the dispatcher's updates go before they are applied.

Without fault tolerance nothing is kept (`NullJournal`). The fault-tolerant journal writes
each update to `work_dir` and replays them on start.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from torch_dataservice.proto import dispatcher_pb2


class Journal(Protocol):
    def append(self, update: dispatcher_pb2.Update) -> None: ...

    def replay(self) -> Iterator[dispatcher_pb2.Update]: ...

    def close(self) -> None: ...


class NullJournal:
    """Keeps nothing: a restarted dispatcher starts empty."""

    def append(self, update: dispatcher_pb2.Update) -> None:
        pass

    def replay(self) -> Iterator[dispatcher_pb2.Update]:
        return iter(())

    def close(self) -> None:
        pass

"""In-order release of a task's elements: split by split, in the order the splits were handed out.

A task's replicas (one per executor process) take splits in turn and finish them out of order,
so a worker with several processes would interleave its splits' elements differently on every
run. The front therefore numbers the splits as it hands them to replicas and releases elements
split by split in that order, like torch's DataLoader (`in_order=True`) orders its workers'
batches: the elements of the earliest split not yet finished (the head) go out at once, later
splits' elements wait here until every split before theirs is finished.

A split is finished when its replica reports it finished (on an ask or on its own, sent after
it emitted all of the split: the messages of one executor arrive in order) or ends. A replica
asks for its next splits ahead, several at once while they are cheap
(worker/executor_process.py), so it may hold several: the one it reads and those it reads
next, in the order they were handed to it, which is the order it reads and reports them in.
No deadlock: the head split's replica has all of its elements released (its earlier splits
are finished, its later ones not started), so readers drain them and its credits come back; a
held split's replica only waits for credits, never the head. What waits here is bounded by the
replicas' credits (worker/executor_process.py), as it was in the task buffer.

Elements without a split (replicas that read no splits: static sharding, one replica) and
elements of a split this order does not know pass straight through.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch_dataservice.wire.splits import SplitKey

_Key = tuple[int, SplitKey]  # (replica, split)


@dataclass
class _Split:
    key: _Key
    held: list[Any] = field(default_factory=list)
    finished: bool = False


class SplitOrder:
    """Not thread-safe: the task's lock guards it."""

    def __init__(self) -> None:
        self._splits: dict[int, _Split] = {}  # hand-out number -> split, from the head on
        self._numbers: dict[_Key, int] = {}
        # replica -> the numbers of the splits it holds and has not finished, in hand-out order
        self._open: dict[int, list[int]] = {}
        self._head = 0
        self._next = 0
        self._bypass = False

    def handed(self, replica: int, split: SplitKey, number: int | None = None) -> None:
        """`split` goes to `replica` (called before the replica can see it), as the `number`-th
        split handed out (default: after every split so far; a caller that hands splits out
        on several threads numbers them where it decides). It finishes no other split: the
        replica may still be reading one (it asks ahead)."""
        if number is None:
            number = self._next
        self._next = max(self._next, number + 1)
        key = (replica, split)
        self._splits[number] = _Split(key)
        self._numbers[key] = number
        self._open.setdefault(replica, []).append(number)

    def admit(self, replica: int, split: SplitKey | None, element: Any) -> bool:
        """True: release `element` now (after the elements returned so far); False: held."""
        if split is None or self._bypass:
            return True
        number = self._numbers.get((replica, split))
        if number is None or number == self._head:
            return True
        self._splits[number].held.append(element)
        return False

    def finished(self, replica: int, split: SplitKey | None = None) -> list[Any]:
        """`replica` finished `split` (None: every split it holds; it ended): the elements
        this releases, in order."""
        numbers = self._open.get(replica)
        if not numbers:
            return []
        if split is None:
            done, numbers[:] = list(numbers), []
        else:
            number = self._numbers.get((replica, split))
            if number is None or number not in numbers:
                return []
            numbers.remove(number)
            done = [number]
        for number in done:
            self._splits[number].finished = True
        return self._advance()

    def flush(self) -> list[Any]:
        """Every held element, in order, and pass everything through from now on (the task
        failed: its readers get what was made before the error)."""
        released = [element for number in sorted(self._splits)
                    for element in self._splits[number].held]
        self._splits.clear()
        self._numbers.clear()
        self._open.clear()
        self._bypass = True
        return released

    @property
    def held(self) -> int:
        """Elements waiting for an earlier split."""
        return sum(len(split.held) for split in self._splits.values())

    def _advance(self) -> list[Any]:
        released: list[Any] = []
        while (split := self._splits.get(self._head)) is not None:
            released += split.held
            split.held = []
            if not split.finished:
                break
            del self._splits[self._head]
            if self._numbers.get(split.key) == self._head:
                del self._numbers[split.key]
            self._head += 1
        return released

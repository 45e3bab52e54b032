"""Exactly-once bookkeeping of one reader (client/delivery.py): what a reader declared silent
drops, and that it may then receive those elements again."""

from __future__ import annotations

from torch_dataservice.client.delivery import Delivery, SplitReceived
from torch_dataservice.proto import worker_pb2


def _header(split: tuple[int, int], offsets: range) -> worker_pb2.ElementBatchHeader:
    header = worker_pb2.ElementBatchHeader()
    for offset in offsets:
        info = header.elements.add(has_split=True, offset=offset)
        info.split.repetition, info.split.index = split
    return header


def test_forgotten_offsets_may_be_received_again() -> None:
    received = SplitReceived()
    for offset in range(10):
        assert received.add(offset)
    received.forget([7, 8, 9])
    assert not received.add(6)
    assert received.add(8) and received.add(7) and received.add(9)
    assert received.below == 10 and received.extra is None


def test_only_elements_of_splits_handed_again_are_dropped() -> None:
    delivery = Delivery()
    mixed = delivery.keep_new(1, _header((0, 1), range(4)), list("abcd"))
    other = delivery.keep_new(2, _header((0, 2), range(3)), list("xyz"))
    # The consumer took "a"; "b", "c", "d" of split 1 are held unacknowledged.
    assert mixed.payloads.popleft() == "a"  # as IterationReader._take
    delivery.acknowledge(mixed)
    mixed.split_tags.popleft()
    assert delivery.drop_unacknowledged({(0, 1)}) == 3
    assert not mixed.payloads and not mixed.tags and not mixed.split_tags
    assert list(other.payloads) == list("xyz"), "a split not handed again was dropped"
    # Handed again, split 1's offsets 1-3 are received once more; offset 0 was taken.
    again = delivery.keep_new(3, _header((0, 1), range(4)), list("ABCD"))
    assert list(again.payloads) == list("BCD")

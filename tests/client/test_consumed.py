"""client/consumed.py: the compact record of what was consumed of an epoch's splits."""

from __future__ import annotations

import json

import pytest

from torch_dataservice.client.consumed import ConsumedSplits


def test_whole_splits_become_ranges_and_partial_ones_a_prefix() -> None:
    consumed = ConsumedSplits()
    for index in range(5):
        for offset in range(4):
            consumed.add(0, index, offset)
    consumed.add(0, 7, 0)
    consumed.add(0, 7, 2)
    consumed.complete_with({(0, i): 4 for i in range(5)} | {(0, 7): 4})
    assert consumed.to_data() == [
        {"repetition": 0, "complete": [[0, 5]], "partial": [[7, 1, [2]]]}]
    assert len(consumed) == 6


def test_merging_ranks_completes_a_split_they_shared() -> None:
    a, b = ConsumedSplits(), ConsumedSplits()
    for offset in (0, 2):
        a.add(1, 3, offset)
    b.add(1, 3, 1)
    a.update(b)
    a.complete_with({(1, 3): 3})
    assert a.to_data() == [{"repetition": 1, "complete": [[3, 4]], "partial": []}]


def test_plain_data_round_trips_through_json_and_proto() -> None:
    consumed = ConsumedSplits()
    consumed.add(0, 0, 0)
    consumed.complete_with({(0, 0): 1})
    consumed.add(0, 2, 5)
    data = json.loads(json.dumps(consumed.to_data()))
    assert ConsumedSplits.from_data(data).to_data() == data
    message = consumed.to_proto()
    assert [(r.start, r.end) for r in message.repetitions[0].complete] == [(0, 1)]
    assert [(p.index, p.below, list(p.extra)) for p in message.repetitions[0].partial] == [
        (2, 0, [5])]


@pytest.mark.parametrize("data", [[{"repetition": -1, "complete": [], "partial": []}],
                                  [{"complete": []}], [{"repetition": 0, "complete": [[3, 1]],
                                                        "partial": []}], 7])
def test_malformed_data_is_refused(data) -> None:
    with pytest.raises(ValueError, match="consumed"):
        ConsumedSplits.from_data(data)

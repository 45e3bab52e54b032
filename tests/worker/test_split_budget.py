"""SplitBudget and end_believed (worker/split_budget.py): the one sizing policy of the task's
split stock and a replica's hold, and the one end-of-repetition rule."""

from __future__ import annotations

import pytest

from torch_dataservice.worker.split_budget import COVER_S, SplitBudget, end_believed

pytestmark = pytest.mark.timeout(10)


def test_before_a_split_was_timed_it_holds_the_unknown_amount() -> None:
    assert SplitBudget(cap=16, ahead=1, unknown=2).target() == 2
    assert SplitBudget(cap=1, ahead=1, unknown=2).target() == 1  # capped
    assert SplitBudget(cap=64, least=1).target(cap=0) == 1  # at least `least`


def test_cheap_splits_fill_the_cap_and_costly_ones_hold_one_ahead() -> None:
    cheap = SplitBudget(cap=64, least=1)
    cheap.note_split(COVER_S / 1000)
    assert cheap.target() == 64
    assert cheap.target(cap=5) == 5  # a lower cap for this once (a replica's credits)
    costly = SplitBudget(cap=64, least=1)
    costly.note_split(COVER_S * 10)
    assert costly.target() == 1
    stock = SplitBudget(cap=16, ahead=1, unknown=2)
    stock.note_split(COVER_S * 10)
    assert stock.target() == 2  # the split under way while more are asked for, and one


def test_a_slow_source_of_splits_covers_twice_its_latency() -> None:
    budget = SplitBudget(cap=100, ahead=1)
    budget.note_split(0.001)
    assert budget.target() == 21  # COVER_S of 1 ms splits, and one ahead
    budget.note_latency(0.05)
    assert budget.target() == 100  # 2 x 50 ms of 1 ms splits: past the cap


def test_a_negative_cap_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="-1"):
        SplitBudget(cap=-1)


def test_an_end_is_believed_only_for_its_repetition_and_with_every_report_out() -> None:
    assert end_believed(ended_for=0, repetition=0, reports_pending=False)
    assert end_believed(ended_for=1, repetition=0, reports_pending=False)
    assert not end_believed(ended_for=0, repetition=0, reports_pending=True)
    assert not end_believed(ended_for=0, repetition=1, reports_pending=False)

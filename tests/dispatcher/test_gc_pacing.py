"""gc_pacing: the survivors of a full collection are frozen (later collections skip them), a
bulk block's objects too, and a sweep still frees a cycle that died after it was frozen."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from torch_dataservice.dispatcher import gc_pacing
from torch_dataservice.dispatcher.gc_pacing import GcPacing


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def pacing() -> Iterator[GcPacing]:
    paced = GcPacing(sweep_every_s=3600).install()
    yield paced
    paced.uninstall()


@pytest.mark.timeout(30)
def test_the_survivors_of_a_full_collection_are_frozen(pacing: GcPacing) -> None:
    state = [Node() for _ in range(1000)]
    gc.collect()
    assert pacing.freezes >= 1
    assert gc.get_freeze_count() >= len(state)
    # A collection after that walks only what is new: the state is not in any generation.
    assert not any(gc.is_tracked(n) and n in gc.get_objects(generation=2) for n in state[:3])


@pytest.mark.timeout(30)
def test_what_a_bulk_block_makes_is_frozen_and_no_collection_runs_inside(
        pacing: GcPacing) -> None:
    # A compaction's copy: containers of tens of thousands of entries that every young
    # collection would walk until they were promoted.
    with gc_pacing.bulk():
        assert not gc.isenabled()
        copy = [{i: {i}} for i in range(1000)]
    assert gc.isenabled()
    young = {id(o) for generation in range(3) for o in gc.get_objects(generation=generation)}
    assert not any(id(d) in young for d in copy[:10]) and id(copy) not in young


@pytest.mark.timeout(30)
def test_bulk_leaves_a_users_collector_alone() -> None:
    with gc_pacing.bulk():  # no GcPacing installed: this process is not the server
        assert gc.isenabled()
        copy = [{i: {i}} for i in range(10)]
    assert gc.get_freeze_count() == 0 and gc.is_tracked(copy)


@pytest.mark.timeout(30)
def test_a_sweep_frees_a_cycle_that_died_frozen(pacing: GcPacing) -> None:
    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    gc.collect()  # the cycle survives, alive: frozen
    del a, b
    gc.collect()  # dead now, but frozen: an ordinary full collection does not see it
    assert gone() is not None
    took = pacing.sweep()
    assert gone() is None and took >= 0 and pacing.sweeps == 1
    assert gc.get_freeze_count() > 0  # what survived the sweep is frozen again


@pytest.mark.timeout(30)
def test_uninstall_leaves_the_collector_as_it_was() -> None:
    paced = GcPacing(sweep_every_s=3600).install()
    gc.collect()
    paced.uninstall()
    assert gc.get_freeze_count() == 0 and paced._on_collection not in gc.callbacks
    gc.collect()
    assert gc.get_freeze_count() == 0


def test_a_sweep_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="sweep_every_s"):
        GcPacing(sweep_every_s=0)

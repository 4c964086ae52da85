"""The garbage collector's pause around a producer's bulk work."""

from __future__ import annotations

import gc
import weakref

import pytest

from carpool import collector


def test_the_collector_is_off_inside_and_back_on_after_even_on_an_error() -> None:
    assert gc.isenabled()
    with collector.paused():
        assert not gc.isenabled()
        with collector.paused():  # nested: still off, and the outer pause turns it back on
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), collector.paused():
        raise KeyError("boom")
    assert gc.isenabled()


def test_a_collector_the_application_turned_off_stays_off() -> None:
    gc.disable()
    try:
        with collector.paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_freeze_startup_collects_the_garbage_then_leaves_what_lives_out_of_later_collections() -> None:
    class Node:
        pass

    garbage = Node()
    garbage.self = garbage  # type: ignore[attr-defined]  # a cycle only the collector can free
    freed = weakref.ref(garbage)
    del garbage
    kept = [Node()]
    try:
        collector.freeze_startup()
        assert freed() is None
        assert gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects())  # out of every generation collected
    finally:
        gc.unfreeze()
    assert any(o is kept for o in gc.get_objects())

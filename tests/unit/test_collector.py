"""The garbage collector's pauses around a producer's bulk work and streams of results."""

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


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_stream_keeps_the_collector_off_from_its_first_hold_until_a_release() -> None:
    clock = _Clock()
    with collector.Stream(longest_s=1.0, clock=clock) as stream:
        assert gc.isenabled() and not stream.held
        stream.hold()
        assert not gc.isenabled() and stream.held
        clock.now += 0.5
        stream.hold()  # a later read of the same stream: still the one pause
        with collector.paused():  # a block's own pause inside the stream's changes nothing
            pass
        assert not gc.isenabled()
        stream.release()  # a read came back empty: the stream went quiet
        assert gc.isenabled() and not stream.held
        stream.hold()
        assert not gc.isenabled()
    assert gc.isenabled(), "leaving the block releases it"


def test_a_stream_that_goes_on_lets_the_collector_run_for_one_read_each_longest_s() -> None:
    clock = _Clock()
    with collector.Stream(longest_s=1.0, clock=clock) as stream:
        stream.hold()
        clock.now += 0.99
        stream.hold()
        assert not gc.isenabled()
        clock.now += 0.01
        stream.hold()  # a full second paused: this read's work runs with the collector on
        assert gc.isenabled() and not stream.held
        stream.hold()  # and the next read pauses it again, for another second
        assert not gc.isenabled()
        clock.now += 0.5
        stream.hold()
        assert not gc.isenabled()


def test_a_stream_releases_on_an_error_and_leaves_a_collector_the_application_turned_off_off() -> None:
    with pytest.raises(KeyError), collector.Stream(longest_s=1.0) as stream:
        stream.hold()
        raise KeyError("boom")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector.Stream(longest_s=1.0) as stream:
            stream.hold()
            assert not stream.held, "not its pause to end"
            stream.release()
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()

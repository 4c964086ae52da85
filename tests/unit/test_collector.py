"""The garbage collector's pauses around a producer's bulk work and streams of results."""

from __future__ import annotations

import gc
import os
import threading
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
        stream.hold()  # a full second paused: the collection due runs during this read's work
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
            stream.release()
            assert not gc.isenabled(), "not its pause to end"
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_pauses_in_two_threads_end_with_the_last_one() -> None:
    """A gather's stream ending in one thread leaves the collector off while a submit_many's bulk
    build in another is still inside its pause, and the other way round."""
    build_inside = threading.Event()
    stream_done = threading.Event()
    seen: list[bool] = []

    def build() -> None:
        with collector.paused():
            build_inside.set()
            stream_done.wait(10)
            seen.append(gc.isenabled())  # the stream's pause ended meanwhile

    with collector.Stream(longest_s=1.0) as stream:
        stream.hold()
        other = threading.Thread(target=build)
        other.start()
        assert build_inside.wait(10)
    stream_done.set()
    other.join(10)
    assert seen == [False], "the stream's release turned the collector on inside the other pause"
    assert gc.isenabled()
    with collector.paused():
        with collector.Stream(longest_s=1.0) as stream:
            stream.hold()
        assert not gc.isenabled(), "the block's pause outlives the stream inside it"
    assert gc.isenabled()


def test_a_pause_cut_short_by_an_exception_never_leaves_the_collector_off() -> None:
    class Interrupting:
        def __call__(self) -> float:
            raise KeyboardInterrupt

    stream = collector.Stream(longest_s=1.0, clock=Interrupting())
    with pytest.raises(KeyboardInterrupt):
        stream.hold()
    stream.release()
    assert gc.isenabled()
    with collector.paused():  # and later pauses still work
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_forked_child_starts_with_no_pause_and_the_collector_on() -> None:
    read, write = os.pipe()
    with collector.paused():
        pid = os.fork()
        if pid == 0:  # the child: report, then leave at once
            with collector.paused():
                inside = gc.isenabled()
            os.write(write, bytes([gc.isenabled(), inside]))
            os._exit(0)
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert os.read(read, 2) == bytes([True, False])
    os.close(read)
    assert status == 0

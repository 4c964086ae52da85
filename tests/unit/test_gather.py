"""carpool.producer.gather.Gathering: the settle / raise / deadline core shared by gather and
gather_async, fed result metas directly (no Redis)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from celery.exceptions import TimeoutError as CeleryTimeout

from carpool.celery_edge.app import app
from carpool.celery_edge.results import FAILURE, SUCCESS
from carpool.errors import DeadlineExceeded, ModelError
from carpool.producer.gather import Gathering, Rows, gather


def _meta(task_id: str, state: str, result: Any) -> dict[str, Any]:
    meta: dict[str, Any] = app.backend.decode_result(
        app.backend.meta_for(task_id, state, result, "2026-01-01T00:00:00")
    )
    return meta


def _results(n: int) -> list[Any]:
    return [app.AsyncResult(f"gather-unit-{i}") for i in range(n)]


def test_settles_in_any_order_and_returns_values_in_order() -> None:
    results = _results(4)
    state = Gathering(results, timeout=None, return_exceptions=False)
    assert state.pending() == [r.id for r in results]
    state.settle([_meta(results[2].id, SUCCESS, "c"), None, _meta(results[0].id, SUCCESS, "a")])
    assert state.pending() == [results[1].id, results[3].id] and not state.done
    state.settle([_meta(results[3].id, "STARTED", None)])  # not final: still waited for
    state.settle([_meta(results[1].id, SUCCESS, "b"), _meta(results[3].id, SUCCESS, "d")])
    assert state.done and state.values() == ["a", "b", "c", "d"]
    assert results[1].get(timeout=1) == "b"  # the AsyncResult itself holds its value now


def test_a_task_listed_twice_settles_both_and_a_second_meta_changes_nothing() -> None:
    first, second = _results(2)
    twin = app.AsyncResult(first.id)
    state = Gathering([first, second, twin], timeout=None, return_exceptions=False)
    state.settle([_meta(first.id, SUCCESS, 1), _meta(first.id, SUCCESS, "duplicate")])
    state.settle([_meta(second.id, SUCCESS, 2)])
    assert state.values() == [1, 2, 1]


def test_the_earliest_failure_learnt_at_once_raises() -> None:
    results = _results(3)
    state = Gathering(results, timeout=None, return_exceptions=False)
    with pytest.raises(DeadlineExceeded, match="late"):
        state.settle(
            [
                _meta(results[2].id, FAILURE, ModelError("broken")),
                _meta(results[1].id, FAILURE, DeadlineExceeded("late")),
            ]
        )
    assert state.pending() == [results[0].id]  # the others keep their failures, collectable


def test_return_exceptions_puts_the_exception_in_place() -> None:
    results = _results(2)
    state = Gathering(results, timeout=None, return_exceptions=True)
    state.settle([_meta(results[0].id, FAILURE, ModelError("broken")), _meta(results[1].id, SUCCESS, 7)])
    values = state.values()
    assert isinstance(values[0], ModelError) and values[1] == 7


def test_results_settled_before_are_not_waited_for() -> None:
    (done, waiting) = _results(2)
    Gathering([done], timeout=None, return_exceptions=False).settle([_meta(done.id, SUCCESS, "x")])
    state = Gathering([done, waiting], timeout=None, return_exceptions=False)
    assert state.pending() == [waiting.id]


def test_deadline() -> None:
    state = Gathering(_results(1), timeout=None, return_exceptions=False)
    assert state.wait_s() == 1.0 and state.remaining_s() is None
    state = Gathering(_results(1), timeout=30, return_exceptions=False)
    assert 0 < state.wait_s() <= 1.0 and 0 < (state.remaining_s() or 0) <= 30
    state = Gathering(_results(1), timeout=0, return_exceptions=False)
    assert state.remaining_s() == 0.0
    with pytest.raises(CeleryTimeout):
        state.wait_s()


def test_results_celery_settled_itself_are_taken_with_their_twins() -> None:
    from carpool.celery_edge.compat import set_cached_meta

    first, second = _results(2)
    twin = app.AsyncResult(first.id)
    state = Gathering([first, second, twin], timeout=None, return_exceptions=False)
    set_cached_meta(first, _meta(first.id, SUCCESS, "from Celery's buffer"))
    state.take_settled()
    assert state.pending() == [second.id]
    state.settle([_meta(second.id, SUCCESS, 2)])
    assert state.values() == ["from Celery's buffer", 2, "from Celery's buffer"]


def _stored_row_meta(task_id: str, row: Any, rows: Rows) -> dict[str, Any]:
    """A success meta as gather's as_array decodes it from the stored bytes."""
    meta: dict[str, Any] = rows.decode(app.backend.meta_for(task_id, SUCCESS, row, "2026-01-01T00:00:00"))
    return meta


def test_as_array_stacks_the_rows_and_leaves_the_async_results_unsettled() -> None:
    from carpool.celery_edge.compat import cached_meta

    first, second, third = _results(3)
    twin = app.AsyncResult(first.id)
    rows = Rows(app.backend, None)
    state = Gathering([first, second, third, twin], timeout=None, return_exceptions=False, rows=rows)
    row = np.array([0.1, -2.5, 3e-8], dtype=np.float32)
    state.settle([_stored_row_meta(first.id, row, rows), _stored_row_meta(third.id, row * 2, rows)])
    state.settle([_meta(second.id, SUCCESS, [1.0, 2.0, 3.0])])  # a list, as Celery's own decoding gives
    got = state.values()
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == (4, 3)
    assert got.tolist() == [row.tolist(), [1.0, 2.0, 3.0], (row * 2).tolist(), row.tolist()]
    # A later .get() must return what it always returns (a list), not an array gather held.
    assert all(cached_meta(r) is None for r in (first, second, third, twin))


def test_as_array_raises_the_earliest_failure_as_gather_does() -> None:
    results = _results(2)
    rows = Rows(app.backend, None)
    state = Gathering(results, timeout=None, return_exceptions=False, rows=rows)
    state.settle([_stored_row_meta(results[0].id, np.ones(4, dtype=np.float32), rows)])
    with pytest.raises(ModelError, match="broken"):
        state.settle([_meta(results[1].id, FAILURE, ModelError("broken"))])


def test_as_array_names_a_result_that_does_not_fit_the_array() -> None:
    rows = Rows(app.backend, None)
    with pytest.raises(ValueError, match=r"result 1 has shape \(2,\), result 0 has \(3,\)"):
        rows.stack([[1.0, 2.0, 3.0], [1.0, 2.0]])
    for odd in (["one"], [None], None, ["1.5"], [[1.0], [2.0, 3.0]]):
        with pytest.raises(ValueError, match="result 1 is not numbers"):
            rows.stack([[1.0], odd])
    with pytest.raises(ValueError, match="needs a numeric dtype"):
        Rows(app.backend, "U8")
    assert rows.stack([]).shape == (0,)
    wide = Rows(app.backend, "float64").stack([np.array([0.1], dtype=np.float32), [0.1]])
    assert wide.dtype == np.float64 and wide.tolist() == [[float(np.float32(0.1))], [0.1]]


def test_gather_refuses_what_as_array_cannot_do_before_waiting() -> None:
    results = _results(1)
    with pytest.raises(ValueError, match="cannot hold a failed request's exception"):
        gather(results, as_array=True, return_exceptions=True)
    with pytest.raises(ValueError, match="dtype applies to as_array=True only"):
        gather(results, dtype="float64")  # type: ignore[call-overload]
    empty = gather([], as_array=True)
    assert isinstance(empty, np.ndarray) and empty.shape == (0,)


def _made_in_threads(n: int) -> list[Any]:
    """One AsyncResult made in each of ``n`` threads of this app: each holds its thread's backend."""
    import threading

    made: list[Any] = []
    threads = [
        threading.Thread(target=lambda i=i: made.append(app.AsyncResult(f"gather-thread-{i}")))
        for i in range(n)
    ]
    for t in threads:
        t.start()
        t.join()
    return sorted(made, key=lambda r: r.id)


def test_results_of_one_app_made_in_other_threads_are_read_with_the_calling_threads_backend() -> None:
    import asyncio

    from carpool.celery_edge.compat import set_cached_meta
    from carpool.producer.gather import _backend_of, gather_async

    results = _made_in_threads(3)
    assert len({id(r.backend) for r in results} | {id(app.backend)}) == 4  # Celery's: one per thread
    assert _backend_of(results) is app.backend
    for i, r in enumerate(results):
        set_cached_meta(r, _meta(r.id, SUCCESS, i))
    assert gather(results) == [0, 1, 2]
    assert asyncio.run(gather_async(results)) == [0, 1, 2]


def test_results_of_different_apps_are_refused_saying_so() -> None:
    import asyncio

    from celery import Celery

    from carpool.producer.gather import _backend_of, gather_async

    other = Celery("other", backend=app.conf.result_backend)
    mixed = [*_results(1), other.AsyncResult("gather-unit-other")]
    with pytest.raises(ValueError, match="one Celery app; these belong to 2 apps"):
        gather(mixed)
    with pytest.raises(ValueError, match="one Celery app; these belong to 2 apps"):
        asyncio.run(gather_async(mixed))
    # A backend given to results, not their app's own: read with it alone, as their .get() would.
    elsewhere = type(app.backend)(app=app, url="redis://127.0.0.1:1/3")
    aside = app.AsyncResult("gather-unit-elsewhere", backend=elsewhere)
    assert _backend_of([aside, aside]) is elsewhere
    with pytest.raises(ValueError, match="one result backend"):
        gather([*_results(1), aside])


def test_eager_results_are_returned_without_reading_redis() -> None:
    """Eager mode (task_always_eager) makes results settled already, with no backend of their own:
    gather returns their values as .get() would, and nothing connects (no Redis runs here)."""
    import asyncio

    from celery.result import EagerResult

    from carpool.producer.gather import gather_async
    from carpool.tasks import infer

    app.conf.task_always_eager = True
    try:
        vector = infer.delay("eager text", model="toy")
    finally:
        app.conf.task_always_eager = False
    assert isinstance(vector, EagerResult)
    failed = EagerResult("gather-eager-failed", ModelError("broken"), FAILURE)
    results = [vector, EagerResult("gather-eager-row", [1.0, 2.0], SUCCESS)]
    assert gather(results, timeout=1) == [vector.get(), [1.0, 2.0]]
    assert asyncio.run(gather_async(results, timeout=1)) == [vector.get(), [1.0, 2.0]]
    rows = gather([results[1], results[1]], as_array=True)
    assert isinstance(rows, np.ndarray) and rows.tolist() == [[1.0, 2.0], [1.0, 2.0]]
    with pytest.raises(ModelError, match="broken"):
        gather([*results, failed])
    with pytest.raises(ModelError, match="broken"):
        asyncio.run(gather_async([*results, failed]))
    mixed = asyncio.run(gather_async([failed, *results], return_exceptions=True))
    assert isinstance(mixed[0], ModelError) and mixed[1:] == [vector.get(), [1.0, 2.0]]


def test_gather_inside_a_task_refuses_to_wait_as_get_does(monkeypatch: pytest.MonkeyPatch) -> None:
    # A worker waiting on other tasks may deadlock: Celery refuses .get() there, unless the task
    # says it may (allow_join_result).
    import asyncio

    from celery import _state

    from carpool.celery_edge.app import app
    from carpool.producer.gather import gather, gather_async

    monkeypatch.setattr(_state, "_task_join_will_block", True)  # what a worker's process sets
    pending = [app.AsyncResult("never-answered")]
    with pytest.raises(RuntimeError, match=r"Never call result\.get"):
        gather(pending, timeout=1)
    with pytest.raises(RuntimeError, match=r"Never call result\.get"):
        asyncio.run(gather_async(pending, timeout=1))

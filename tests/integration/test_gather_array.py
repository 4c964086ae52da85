"""``gather(..., as_array=True)``: every way a result reaches gather (the store, the result inbox, a
result's own channel, gather_async's connection) ends in one array of the values ``.get()`` returns."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from carpool.tools.embedded import EmbeddedRedis
from carpool.tools.workload import mixed_texts
from tests.integration.conftest import Processes, start_stack, store_later

pytestmark = pytest.mark.integration


def _rows(n: int, dim: int = 384) -> np.ndarray:
    rng = np.random.default_rng(n)
    rows = rng.standard_normal((n, dim)).astype(np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    return rows


def test_rows_from_the_store_and_the_inbox_come_back_as_one_exact_array(
    clean_redis: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    from carpool.celery_edge.app import app
    from carpool.celery_edge.inbox import inbox_of
    from carpool.celery_edge.results import SUCCESS, success_row
    from carpool.producer import gather as gathering
    from carpool.producer.gather import gather
    from carpool.producer.submit import submit_many

    read_as_rows: list[bool] = []

    def counted(payload: bytes) -> Any:
        meta = success_row(payload)
        read_as_rows.append(meta is not None)
        return meta

    monkeypatch.setattr(gathering, "success_row", counted)

    backend = app.backend
    results = submit_many([f"text {i}" for i in range(40)], model="toy")
    rows = _rows(40)
    inboxes = {r.id: inbox_of(r) or "" for r in results}
    # The first ten are stored before gather subscribes (read from the store), the rest while it
    # waits (through the inbox); one of them as a list of Python floats, as a @batched task stores.
    backend.store_many([(r.id, SUCCESS, rows[i]) for i, r in enumerate(results[:10])])
    later = [(r.id, SUCCESS, rows[i + 10]) for i, r in enumerate(results[10:])]
    later[5] = (later[5][0], SUCCESS, rows[15].tolist())
    worker = store_later(backend, later, 0.3, inboxes=inboxes)
    try:
        got = gather(results, timeout=20, as_array=True)
    finally:
        worker.join()
    assert isinstance(got, np.ndarray) and got.dtype == np.float32 and got.shape == (40, 384)
    assert np.array_equal(got, rows)
    # Each was read from its bytes, without a Python float per value: the list of Python floats too
    # (msgpack stores it as a float64 row).
    assert read_as_rows == [True] * 40
    # gather left the AsyncResults to their own reading: .get() returns the lists it always did.
    assert [r.get(timeout=10) for r in results[8:12]] == [row.tolist() for row in rows[8:12]]


def test_per_result_channels_gather_async_and_a_failure(clean_redis: EmbeddedRedis) -> None:
    from carpool.celery_edge.app import create_app
    from carpool.celery_edge.results import FAILURE, SUCCESS
    from carpool.config import load_settings
    from carpool.errors import ModelError
    from carpool.producer.gather import gather, gather_async
    from carpool.producer.submit import submit_many
    from carpool.tools.harness import release_result_consumer

    app = create_app(load_settings(result_inbox=False))  # each result on its own channel
    try:
        results = submit_many([f"text {i}" for i in range(30)], model="toy", app=app)
        rows = _rows(30, dim=16).astype(np.float64)  # a float64 row is read exactly too
        worker = store_later(app.backend, [(r.id, SUCCESS, rows[i]) for i, r in enumerate(results)], 0.3)
        try:
            got = gather(results, timeout=20, as_array=True, dtype="float64")
        finally:
            worker.join()
        assert got.dtype == np.float64 and np.array_equal(got, rows)
        # Done waiting for them, as after a gather of lists: nothing left subscribed or pending.
        assert not app.backend.result_consumer.subscribed_to
        assert not any(r.id in pending for pending in app.backend._pending_results for r in results)

        fresh = submit_many([f"again {i}" for i in range(12)], model="toy", app=app, subscribe=False)
        entries: list[Any] = [(r.id, SUCCESS, rows[i]) for i, r in enumerate(fresh)]
        worker = store_later(app.backend, entries, 0.3)
        try:
            got_async = asyncio.run(gather_async(fresh, timeout=20, as_array=True))
        finally:
            worker.join()
        assert got_async.dtype == np.float32 and np.array_equal(got_async, rows[:12].astype(np.float32))

        failing = submit_many(["a", "b", "c"], model="toy", app=app)
        app.backend.store_many([(failing[0].id, SUCCESS, rows[0]), (failing[2].id, SUCCESS, rows[2])])
        app.backend.store_result(failing[1].id, ModelError("broken row"), FAILURE)
        with pytest.raises(ModelError, match="broken row"):
            gather(failing, timeout=20, as_array=True)
    finally:
        release_result_consumer(app)


@pytest.mark.slow
def test_minilm_embeddings_through_coordinator_and_worker_as_one_array(processes: Processes) -> None:
    """Real processes and the real model: the array holds exactly the vectors ``.get()`` returns."""
    from carpool.producer.gather import gather
    from carpool.producer.submit import submit_many

    start_stack(processes, CARPOOL_MODEL="minilm", CARPOOL_MODELS="minilm")
    texts = mixed_texts(150, seed=41)
    results = submit_many(texts, model="minilm")
    got = gather(results, timeout=120, as_array=True)
    assert got.dtype == np.float32 and got.shape == (150, 384)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert np.array_equal(got, np.array([r.get(timeout=30) for r in results], dtype=np.float32))

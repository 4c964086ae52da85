"""Real parts: a redis-server on a random port for the session, real coordinator/worker processes.

The processes come from :class:`carpool.tools.harness.Harness`, the harness ``carpool demo`` and
``carpool bench`` use; tests know it as ``Processes``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from carpool.tools.embedded import EmbeddedRedis
from carpool.tools.harness import Harness, release_result_consumer
from tests.tolerances import VECTOR_ATOL


def assert_same_vectors(got: Any, want: Any) -> None:
    """``got`` and ``want`` are the same vector, or lists of vectors of the same shape, within
    ``VECTOR_ATOL``; two runs of one text may sit in batches of different shapes."""
    import numpy as np

    g, w = np.asarray(got), np.asarray(want)
    assert g.dtype.kind == "f" and w.dtype.kind == "f", f"not all numbers: {g.dtype}, {w.dtype}"
    assert np.isfinite(g).all() and np.isfinite(w).all(), "a NaN or an infinity"
    assert g.shape == w.shape, f"shapes differ: {g.shape} != {w.shape}"
    far = np.abs(g - w) > VECTOR_ATOL
    if g.ndim > 1:
        wrong = np.flatnonzero(far.reshape(len(g), -1).any(axis=1)).tolist()
        assert not wrong, f"vectors {wrong} differ by more than {VECTOR_ATOL}"
    else:
        assert not far.any(), f"the vectors differ by {np.abs(g - w).max()} > {VECTOR_ATOL}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test in this folder is an integration test (``-m "not integration"`` leaves them out);
    a ``pytestmark`` in a conftest would mark nothing."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.path).parents:
            item.add_marker(pytest.mark.integration)


# ``Processes(server, log_dir)``: coordinators and workers with their own environment on ``server``,
# logs kept in ``log_dir`` for failure messages.
Processes = Harness


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    # tests/conftest.py already pointed CARPOOL_BROKER_URL and CARPOOL_RESULT_BACKEND at this port.
    with EmbeddedRedis(port=int(os.environ["CARPOOL_TEST_REDIS_PORT"])) as server:
        yield server
        release_result_consumer()


@pytest.fixture()
def clean_redis(redis_server: EmbeddedRedis) -> EmbeddedRedis:
    import redis

    redis.Redis(port=redis_server.port).flushall()
    return redis_server


@pytest.fixture()
def processes(clean_redis: EmbeddedRedis, tmp_path: Path) -> Iterator[Processes]:
    with Processes(clean_redis, tmp_path) as procs:
        yield procs


def start_stack(processes: Processes, workers: int = 1, /, **env: str) -> Processes:
    """A coordinator and ``workers`` GPU workers sharing ``env`` (CARPOOL_* overrides), all up."""
    # ``workers`` positional and ``wait`` given: a ``**dict[str, str]`` of settings can fill neither.
    return processes.start_stack(workers, wait=True, **env)


def wait_for(what: str, check: Callable[[], Any], timeout_s: float = 30.0, every_s: float = 0.1) -> Any:
    """Poll ``check`` until it returns something truthy, and return that; fail naming ``what`` and
    the last answer or error. OSError (a refused connection, an HTTP error), ValueError (a body not
    yet JSON) and AssertionError (a check that says why it is not there yet) count as "not yet"."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        try:
            value = check()
            if value:
                return value
            last = value
        except (OSError, ValueError, AssertionError) as exc:
            last = exc
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not seen within {timeout_s}s (last: {last!r})")
        time.sleep(every_s)


def server_of(processes: Processes) -> EmbeddedRedis:
    """The redis-server ``processes`` runs on: the fixtures always give it one."""
    assert processes.server is not None
    return processes.server


def requests_in(client: Any, key: str) -> dict[bytes, bytes]:
    """The request ids an in-flight hash (owner, claimed) holds, without the field ``''`` that keeps
    it a hash table."""
    held = dict(client.hgetall(key))
    held.pop(b"", None)
    return held


def as_bytes(reply: object) -> bytes:
    """``reply`` from a client without ``decode_responses``: bytes, though redis-py's types allow more."""
    assert isinstance(reply, bytes), reply
    return reply


def store_later(
    backend: Any, entries: Any, after_s: float, when: Callable[[], bool] | None = None, **kwargs: Any
) -> threading.Thread:
    """A thread that stores ``entries`` through ``backend`` (not its own thread-local one) after a
    pause and, given ``when``, once ``when()`` holds."""

    def store() -> None:
        time.sleep(after_s)
        if when is not None:
            wait_for("the condition to store on", when)
        backend.store_many(entries, **kwargs)

    thread = threading.Thread(target=store)
    thread.start()
    return thread

"""carpool on a redis-server that listens only on a Unix socket (no TCP port at all).

Every client then has to reach it through the socket: the producer's own messages and its
``gather``, Celery's publish (a ``countdown`` request goes through kombu), Celery's result backend
under ``.get()``, and the coordinator and worker processes, started with the socket's URLs. A
plain Celery app, configured with the same URLs as a Celery user would write them, reads the results.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from carpool.celery_edge.app import create_app
from carpool.config import load_settings
from carpool.errors import ConfigError
from carpool.gpu_worker.runner import run_single
from carpool.producer.gather import gather
from carpool.producer.submit import submit_many
from carpool.tools.embedded import EmbeddedRedis, free_port
from carpool.tools.harness import Harness, release_result_consumer
from carpool.tools.workload import mixed_texts
from tests.integration.conftest import assert_same_vectors, wait_for

TOY: dict[str, Any] = {"model": "toy", "models": ("toy",)}


def test_a_stack_on_a_unix_socket_serves_every_path_and_a_plain_celery_client(tmp_path: Path) -> None:
    import carpool.tasks  # noqa: F401  # registers carpool.infer on every app

    with EmbeddedRedis(unix_socket=True) as server:
        broker_url, backend_url = server.url(0), server.url(1)
        assert broker_url.startswith("redis+socket:///") and backend_url.endswith("virtual_host=1")
        # redis-py's spelling of the same socket is taken and rewritten into Celery's
        settings = load_settings(broker_url=f"unix://{server.socket_path}?db=0", result_backend=backend_url)
        assert settings.broker_url == broker_url
        app = create_app(settings.model_copy(update=TOY))
        plain = Celery("plain", broker=broker_url, backend=backend_url)
        plain.conf.update(result_serializer="msgpack", result_accept_content=["msgpack"])  # as carpool's app
        with Harness(server, tmp_path) as processes:
            processes.start_stack(1, wait=True, CARPOOL_MODEL="toy", CARPOOL_MODELS="toy")
            try:
                texts = mixed_texts(48, seed=23)
                got = gather(submit_many(texts, app=app), timeout=60)
                want = [run_single("toy", t) for t in texts]
                assert_same_vectors(got, want)
                task = app.tasks["carpool.infer"]
                one = task.delay(texts[0])
                later = task.apply_async((texts[1],), countdown=0.3)  # Celery's own publish
                assert_same_vectors([one.get(timeout=60), later.get(timeout=60)], want[:2])
                # read by plain Celery, under the request's own id
                read = plain.AsyncResult(one.id)
                assert_same_vectors([read.get(timeout=10)], want[:1])
                assert plain.AsyncResult(later.id).state == "SUCCESS"
                del read  # unsubscribes now, while the server is there to hear it
                with pytest.raises(ConfigError, match="database"):
                    load_settings(broker_url=f"unix://{server.socket_path}?db=0&virtual_host=1")
            finally:
                release_result_consumer(app)
                app.close()
                plain.close()
            assert processes.procs["coordinator"].poll() is None
            assert processes.procs["worker0"].poll() is None


def test_flower_on_a_unix_socket_lists_the_requests_and_counts_a_queue(tmp_path: Path) -> None:
    """Flower, given carpool's app and the socket's URLs as every other process is: its event
    receiver (Redis pub/sub on the socket) lists each request as SUCCESS, and its broker API counts
    a queue's messages (with no worker up, the app's default queue: the request queue), which it reads
    through its own socket client."""
    import carpool.tasks  # noqa: F401  # registers carpool.infer on every app

    def api(path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
            return json.loads(resp.read())

    with EmbeddedRedis(unix_socket=True) as server, Harness(server, tmp_path) as processes:
        toy = {"CARPOOL_MODEL": "toy", "CARPOOL_MODELS": "toy"}
        port = free_port()
        flower = processes.spawn(
            "flower",
            ["celery", "-A", "carpool.celery_app", "flower", f"--port={port}", "--address=127.0.0.1"],
            FLOWER_UNAUTHENTICATED_API="true",
            **toy,
        )
        deadline = time.monotonic() + 60
        with redis.Redis(unix_socket_path=server.socket_path) as client:
            # the request queue, before anything consumes it: what Flower's broker page shows
            client.rpush("carpool.requests", b"not-a-message-1", b"not-a-message-2")
            while True:
                assert flower.poll() is None, processes.log("flower")
                try:
                    queues = api("/api/queues/length")["active_queues"]
                    break
                except (urllib.error.URLError, ConnectionError):
                    assert time.monotonic() < deadline, processes.log("flower")
                    time.sleep(0.3)
            client.delete("carpool.requests")
        assert {"name": "carpool.requests", "messages": 2} in queues, queues
        settings = load_settings(broker_url=server.url(0), result_backend=server.url(1))
        app = create_app(settings.model_copy(update=TOY))
        processes.start_stack(1, wait=True, **toy)
        deadline = time.monotonic() + 60
        try:

            def succeeded() -> dict[str, Any]:
                tasks = api("/api/tasks?taskname=carpool.infer")
                return {i: t for i, t in tasks.items() if t["state"] == "SUCCESS"}

            def send_round(seed: int) -> list[str]:
                ids = [r.id for r in submit_many(mixed_texts(4, seed=seed), app=app)]
                gather([app.AsyncResult(i) for i in ids], timeout=60)
                return ids

            # Flower answers HTTP before its event receiver subscribes: requests sent until then are
            # not shown, so send rounds until one of a round is; then every one of a new round must be.
            ids: list[str] = []
            rounds = 0
            while not any(i in succeeded() for i in ids):
                assert time.monotonic() < deadline, processes.log("flower")
                rounds += 1
                ids = send_round(rounds)
                time.sleep(0.5)
            ids = send_round(rounds + 1)
            listed = wait_for(
                "the last round's requests in flower", lambda: all(i in (s := succeeded()) for i in ids) and s
            )
            assert all(i in listed for i in ids), (ids, sorted(listed), processes.log("flower"))
        finally:
            release_result_consumer(app)
            app.close()

"""carpool on a redis-server that listens only on a Unix socket (no TCP port at all).

Every client then has to reach it through the socket: the producer's own messages and its
``gather``, Celery's publish (a ``countdown`` request goes through kombu), Celery's result backend
under ``.get()``, and the coordinator and worker processes, started with the socket's URLs. A
plain Celery app, configured with the same URLs as a Celery user would write them, reads the results.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery

from carpool.celery_edge.app import create_app
from carpool.config import load_settings
from carpool.errors import ConfigError
from carpool.gpu_worker.runner import run_single
from carpool.producer.gather import gather
from carpool.producer.submit import submit_many
from carpool.tools.embedded import EmbeddedRedis
from carpool.tools.harness import Harness, release_result_consumer
from carpool.tools.workload import mixed_texts
from tests.integration.test_end_to_end import assert_same_vectors


def test_a_stack_on_a_unix_socket_serves_every_path_and_a_plain_celery_client(tmp_path: Path) -> None:
    import carpool.tasks  # noqa: F401  # registers carpool.infer on every app

    with EmbeddedRedis(unix_socket=True) as server:
        broker_url, backend_url = server.url(0), server.url(1)
        assert broker_url.startswith("redis+socket:///") and backend_url.endswith("virtual_host=1")
        # redis-py's spelling of the same socket is taken and rewritten into Celery's
        settings = load_settings(broker_url=f"unix://{server.socket_path}?db=0", result_backend=backend_url)
        assert settings.broker_url == broker_url
        app = create_app(settings.model_copy(update={"model": "toy", "models": ("toy",)}))
        plain = Celery("plain", broker=broker_url, backend=backend_url)
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

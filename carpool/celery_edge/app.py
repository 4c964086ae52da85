"""The carpool Celery app: ``celery -A carpool.celery_edge.app flower`` works against it.

Producers, the coordinator and workers share this configuration: JSON only (pickle would execute
code on load), carpool's own result backend (see ``carpool.celery_edge.results``), requests routed to the
request queue the coordinator drains, batches to the queue GPU workers consume.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from carpool.config import Settings, load_settings
from carpool.names import INFER_TASK, RUN_BATCH_TASK


class CarpoolCelery(Celery):  # type: ignore[misc]
    """Celery with carpool's result backend class and the plain URL in ``result_backend``.

    Naming the class in the URL (``module:Class+redis://...``) would work too, but Celery's URL
    masking then fails and ``celery report`` / the worker banner would print the password.
    """

    def _get_backend(self) -> Any:
        from carpool.celery_edge.results import CarpoolRedisBackend

        return CarpoolRedisBackend(app=self, url=self.conf.result_backend)


def create_app(settings: Settings | None = None) -> Celery:
    settings = settings or load_settings()
    # include: a plain `celery worker` on the request queue (the one-task-per-request baseline of
    # `carpool bench`) must know carpool.infer; importing carpool.tasks pulls no torch.
    app = CarpoolCelery(
        "carpool", broker=settings.broker_url, backend=settings.result_backend, include=["carpool.tasks"]
    )
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        event_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_routes={
            INFER_TASK: {"queue": settings.request_queue},
            RUN_BATCH_TASK: {"queue": settings.batch_queue},
        },
        task_default_queue=settings.batch_queue,
        result_expires=settings.result_expires_s,
        # One batch at a time per worker process: the coordinator, not the prefetch, sizes batches.
        worker_prefetch_multiplier=1,
        # Batches are acked when they start; a worker that dies mid-batch is covered by carpool's own
        # lease on each request (CARPOOL_RECOVERY_TIMEOUT_S), not by kombu's hour-long visibility timeout.
        task_acks_late=False,
        # ...and so kombu's ack emulation (each fetched message copied into an "unacked" hash, then
        # removed on ack: two more round trips per batch) protects nothing carpool needs; a batch
        # message lost with a killed worker is recovered through the leases of its requests.
        broker_transport_options={"ack_emulation": False},
        broker_connection_retry_on_startup=True,
        task_send_sent_event=True,
        worker_send_task_events=True,
        worker_hijack_root_logger=False,
    )
    app.carpool_settings = settings
    return app


app = create_app()


def settings_of(celery_app: Celery) -> Settings:
    """The settings the app was built from (every carpool process reads them from here)."""
    settings: Settings = celery_app.carpool_settings
    return settings

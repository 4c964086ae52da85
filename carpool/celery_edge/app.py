"""The carpool Celery app: ``celery -A carpool.celery_edge.app flower`` works against it.

Producers, the coordinator and workers share this configuration: JSON only (pickle would execute
code on load), carpool's own result backend (see ``carpool.celery_edge.results``), requests routed to the
request queue the coordinator drains, batches to the queue GPU workers consume.
"""

from __future__ import annotations

import os
import re
import threading
from typing import TYPE_CHECKING, Any

from celery import Celery

from carpool.celery_edge import compat
from carpool.celery_edge.events import Heard
from carpool.config import Settings, load_settings
from carpool.names import INFER_TASK, RUN_BATCH_TASK
from carpool.redis_edge.socket_options import celery_options, client_options

if TYPE_CHECKING:
    import redis


_PUBLISH_SLOTS = 1024  # at most, whatever the pool allows


class AppState:
    """What carpool keeps per Celery app: its settings, and producer helpers built on first use."""

    def __init__(self, app: Celery, settings: Settings) -> None:
        self.settings = settings
        self._app = app
        self._connection: Any = None
        self._channel: Any = None
        self._publisher: redis.Redis | None = None
        self._dispatcher: tuple[int, Any] | None = None  # (pid, dispatcher)
        self._slots: tuple[int, threading.BoundedSemaphore] | None = None  # (pid, publishing slots)
        self._slots_lock = (os.getpid(), threading.Lock())
        #: message builders kept between publishes (see carpool.producer.submit), per thread and options
        self.builders: dict[tuple[Any, ...], Any] = {}
        #: (pid, channel) of this process's result inbox (see carpool.celery_edge.inbox)
        self.inbox: tuple[int, str] | None = None
        #: whether the task-sent events published last reached anyone (CARPOOL_EVENTS=auto)
        self.sent_heard = Heard()
        #: the task_routes carpool's app set: while they stand, a carpool task goes to the request queue
        self.routes: Any = app.conf.task_routes

    def request_queue(self, name: str, args: Any = (), kwargs: Any = None) -> str:
        """The queue a request for carpool task ``name`` goes to: the request queue, unless routes
        the application set ahead of carpool's route it elsewhere (a second pool of coordinators)."""
        default = self.settings.request_queue
        if self._app.conf.task_routes is self.routes:
            return default
        queue = self._app.amqp.router.route({}, name, args, kwargs).get("queue")
        return getattr(queue, "name", None) or default

    def message_channel(self) -> Any:
        """A kombu Redis channel of the broker, used only to build messages (no I/O), kept because
        opening one costs a connection and a PING."""
        if self._channel is None:
            self._connection = self._app.connection_for_write()
            self._channel = self._connection.default_channel
        return self._channel

    def publisher(self) -> redis.Redis:
        """A ``redis.Redis`` on that channel's connection pool, kept because kombu builds a new client
        for every publish; the pool (kombu's, with the broker URL's settings) reconnects by itself."""
        if self._publisher is None:
            client = compat.new_client(self.message_channel())
            # One retry on a fresh connection, as carpool's own clients make: a request published
            # twice is answered once (results are write-once); this channel serves nothing else.
            client.set_retry(client_options(self.settings)["retry"])
            self._publisher = client
        return self._publisher

    def publishing(self) -> threading.BoundedSemaphore:
        """Held around each use of :meth:`publisher`: its pool (kombu's) raises past its connections
        (10) where Celery's producer pool waits, so a thread beyond them waits here instead."""
        pid = os.getpid()  # a forked child counts its own (a parent's thread may have held one)
        made = self._slots
        if made is not None and made[0] == pid:
            return made[1]
        if self._slots_lock[0] != pid:  # ...and its own lock, which a parent's thread may have held
            self._slots_lock = (pid, threading.Lock())
        pool = self.publisher().connection_pool
        slots = min(getattr(pool, "max_connections", None) or _PUBLISH_SLOTS, _PUBLISH_SLOTS)
        with self._slots_lock[1]:
            if self._slots is None or self._slots[0] != pid:
                self._slots = (pid, threading.BoundedSemaphore(slots))
            return self._slots[1]

    def close(self) -> None:
        """Disconnect what was built on first use (the next use builds it again)."""
        if self._publisher is not None:
            self._publisher.connection_pool.disconnect()
            self._publisher = None
        if self._connection is not None:
            self._connection.release()  # its channel and that channel's connection pool
            self._connection = self._channel = None
        self.builders.clear()

    def event_dispatcher(self) -> Any:
        """A disabled event dispatcher: the hostname, clock, exchange and headers that task-sent
        events carry, as ``send_task`` gives them."""
        pid = os.getpid()  # its hostname names the process (gen<pid>@host): a forked child's own
        if self._dispatcher is None or self._dispatcher[0] != pid:
            self._dispatcher = (pid, self._app.events.Dispatcher(enabled=False))
        return self._dispatcher[1]


class CarpoolCelery(compat.AppWithBackendClass):
    """Celery with carpool's result backend class and the plain URL in ``result_backend``.

    Naming the class in the URL (``module:Class+redis://...``) would work too, but Celery's URL
    masking then fails and ``celery report`` / the worker banner would print the password.
    """

    carpool: AppState

    def bugreport(self) -> str:
        """Celery's report (``celery report``), with every password in it masked: Celery masks a URL's
        first address only, and carpool's sentinel:// URLs carry the password on each address."""
        report: str = super().bugreport()
        return _PASSWORD_IN_URL.sub(r"\1********@", report)

    def close(self) -> None:
        """Celery's close, and the connections carpool keeps beside Celery's pool closed: the
        publisher of ``.delay()`` and ``submit_many``, this thread's result backend's client and
        its pub/sub."""
        backend = compat.made_backend(self)  # none is made just to be closed
        if backend is not None:
            consumer = getattr(backend, "result_consumer", None)
            if consumer is not None and hasattr(consumer, "release"):
                consumer.release()
            client = compat.made_client(backend)
            if client is not None:
                client.connection_pool.disconnect()
        state = getattr(self, "carpool", None)
        if state is not None:
            state.close()
        # Celery's broker pool is left to Celery: kombu keys it by the connection's address and
        # shares it with every app of this process on the same broker, so closing it here would
        # close theirs.
        super().close()

    def _task_from_fun(self, fun: Any, name: Any = None, **options: Any) -> Any:
        """Celery's task registration, refusing a name a batched task shares with another task.

        Celery keeps the first task registered under a name and hands it to every later decorator
        of that name, so ``@batched(name=N)`` beside a plain ``@app.task(name=N)`` would silently
        make one of the two functions dead code.
        """
        task = super()._task_from_fun(fun, name=name, **options)
        spec, known = options.get("spec"), getattr(task, "spec", None)
        if (spec is not None or known is not None) and not _same_spec(spec, known):
            from carpool.errors import ConfigError

            plain = "a plain Celery task" if known is None or spec is None else "another task"
            raise ConfigError(
                f"{task.name!r} names both a @batched task and {plain}; give one of them another name"
                " (name= in @batched or @app.task)"
            )
        return task

    def result_backend_class(self) -> type[Any]:
        from carpool.celery_edge.results import CarpoolRedisBackend, CarpoolSentinelBackend
        from carpool.redis_edge.connect import is_sentinel

        return CarpoolSentinelBackend if is_sentinel(str(self.conf.result_backend)) else CarpoolRedisBackend


def _same_spec(a: Any, b: Any) -> bool:
    """Whether two registrations are of one batched task (a module imported twice decorates the
    same function again)."""
    if a is None or b is None:
        return a is b
    return a is b or (type(a) is type(b) and getattr(a, "fn", 0) is getattr(b, "fn", 0))


# The password of a URL's user info (scheme://[user]:password@), up to the address it guards.
_PASSWORD_IN_URL = re.compile(r"(://[^:/@;\s'\"]*:)[^@;\s'\"]+@")


_MAP_TASKS = frozenset({"celery.map", "celery.starmap"})


def _router(app: Celery, settings: Settings) -> Any:
    """A Celery router: every ``@batched`` task's requests to the request queue (a ``.map()`` /
    ``.starmap()`` / ``.chunks()`` of one refused before it is sent); any other task this process
    knows, with no route of its own, to the batch queue, whose workers run it as Celery would; a
    name it does not know to the app's default queue, the request queue, whose coordinators batch
    it (a ``@batched`` task of their ``CARPOOL_IMPORTS``) or answer why they cannot."""

    def route(
        name: str, args: Any = None, kwargs: Any = None, *_: Any, task: Any = None, **__: Any
    ) -> dict[str, str] | None:
        from carpool.registry import spec_for

        sent = getattr(task, "name", None) or name
        if name == RUN_BATCH_TASK:
            # Only a coordinator sends batches, to the queue it names (which overrides this route);
            # any other send of it (a plain task's link applied by Celery's tracer, send_task) goes
            # to the coordinators, which answer it under its id with why it cannot be sent.
            return {"queue": settings.request_queue}
        # Celery's celery.map / celery.starmap (.map(), .starmap(), and each part of .chunks()): one
        # message holding every item, which the coordinators cannot batch. .map() routes it as the
        # task it calls; a group of chunks sends it under its own name, the task in its kwargs.
        called = name
        if name in _MAP_TASKS and isinstance(kwargs, dict) and isinstance(kwargs.get("task"), dict):
            called = str(kwargs["task"].get("task"))
        if spec_for(called) is None:
            return {"queue": settings.batch_queue} if called in app.tasks else None
        if sent != called:
            from carpool.errors import UnsupportedOption

            raise UnsupportedOption(
                f"{called}: .map(), .starmap() and .chunks() ({sent}) are not supported by carpool"
                " tasks: Celery runs every item of them in one task, unbatched; send the items with"
                " carpool.submit_many(items, task=...) and collect them with carpool.gather()"
            )
        return {"queue": settings.request_queue}

    return route


def create_app(settings: Settings | None = None) -> Celery:
    settings = settings or load_settings()
    # include: a plain `celery worker` on the request queue (the one-task-per-request baseline of
    # `carpool bench`) must know carpool.infer; importing carpool.tasks pulls no torch.
    app = CarpoolCelery(
        "carpool",
        broker=settings.broker_url,
        backend=settings.result_backend,
        include=["carpool.tasks"],
        set_as_current=False,
    )
    # Celery's app-less APIs (current_app, AsyncResult(id), shared_task's .delay()) keep using an
    # application's own app made before carpool was imported; carpool's is current where none is.
    if not compat.has_current_app():
        app.set_current()
    sockets = celery_options(settings)  # timeouts, keepalive, health checks: a dead peer is noticed
    app.conf.update(
        sockets,
        task_serializer="json",
        result_serializer=settings.result_serializer,
        event_serializer="json",
        accept_content=["json"],
        # Both, whichever this process writes: results stored under the other setting stay readable.
        result_accept_content=["json", "msgpack"],
        task_routes=(
            _router(app, settings),
            {INFER_TASK: {"queue": settings.request_queue}},
        ),
        # A name this process cannot route (send_task of a task whose module it does not import, a
        # link to one) goes to the coordinators, which batch it or answer why they cannot; on the
        # batch queue a worker's tracer would run it alone, unchecked, or leave it unanswered.
        task_default_queue=settings.request_queue,
        result_expires=settings.result_expires_s,
        # One batch at a time per worker process: the coordinator, not the prefetch, sizes batches.
        worker_prefetch_multiplier=1,
        # Batches are acked when they start; a worker that dies mid-batch is covered by carpool's own
        # lease on each request (CARPOOL_RECOVERY_TIMEOUT_S), not by kombu's hour-long visibility timeout.
        task_acks_late=False,
        # ...and so kombu's ack emulation (each fetched message copied into an "unacked" hash, then
        # removed on ack: two more round trips per batch) protects nothing carpool needs; a batch
        # message lost with a killed worker is recovered through the leases of its requests.
        broker_transport_options={
            **sockets["broker_transport_options"],
            "ack_emulation": False,
            **_sentinel_options(settings.broker_url, settings),
        },
        result_backend_transport_options=_sentinel_options(settings.result_backend, settings),
        broker_connection_retry_on_startup=True,
        # CARPOOL_EVENTS=false holds for the sends Celery's own publish makes too (countdown, send_task,
        # callbacks): a task-sent event that nothing follows would leave Flower showing it PENDING.
        task_send_sent_event=settings.events is not False,
        worker_send_task_events=True,
        worker_hijack_root_logger=False,
    )
    app.carpool = AppState(app, settings)
    return app


def decode_json_fast() -> None:
    """kombu's ``json`` serializer in this process decodes with :func:`carpool.codec.loads_tagged`
    (the same values, faster); its encoder stays kombu's. For the worker, which decodes a batch
    message's body twice (Celery's strategy looks inside it, then its tracer decodes it again)."""
    from kombu.serialization import register
    from kombu.utils.json import dumps

    from carpool.codec import loads_tagged

    register("json", dumps, loads_tagged, content_type="application/json", content_encoding="utf-8")  # type: ignore[no-untyped-call]


def _sentinel_options(url: str, settings: Settings) -> dict[str, Any]:
    """The transport options kombu's and Celery's Sentinel support read, for a sentinel:// ``url``."""
    from carpool.redis_edge.connect import is_sentinel, transport_options

    return transport_options(settings) if is_sentinel(url) else {}


app = create_app()


def state_of(celery_app: Celery) -> AppState:
    """What carpool keeps for ``celery_app``; TypeError if :func:`create_app` did not make it."""
    state = getattr(celery_app, "carpool", None)
    if not isinstance(state, AppState):
        raise TypeError(
            f"{celery_app!r} is not a carpool app: make it with carpool.celery_edge.app.create_app()"
        )
    return state


def settings_of(celery_app: Celery) -> Settings:
    """The settings the app was built from (every carpool process reads them from here)."""
    return state_of(celery_app).settings

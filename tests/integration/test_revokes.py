"""A coordinator's revoke listener, against the session's redis-server and Celery's own broadcast.

``AsyncResult.revoke()`` is a PUB/SUB broadcast: one published before the listener's SUBSCRIBE is
in effect reaches nobody. The coordinator starts taking requests only once ``listen`` returns, so
a revoke of anything it took must be heard.
"""

from __future__ import annotations

from carpool.celery_edge.app import app
from carpool.config import Settings
from carpool.coordinator import revokes
from carpool.tools.embedded import EmbeddedRedis
from tests.integration.conftest import wait_for


def first_heard(listener: revokes.RevokeListener, what: str) -> list[str]:
    """The ids of the first take that holds any (waiting up to 10 s for one)."""
    taken: list[str] = wait_for(what, listener.take, timeout_s=10)
    return taken


def test_a_revoke_sent_as_soon_as_the_listener_started_is_heard(clean_redis: EmbeddedRedis) -> None:
    for attempt in range(20):  # without the wait for the subscription, most of these are missed
        listener = revokes.listen(app, Settings())
        assert listener is not None
        try:
            app.control.revoke(f"revoked-{attempt}")
            assert first_heard(listener, f"revoke {attempt} heard") == [f"revoked-{attempt}"]
        finally:
            listener.stop()


def test_a_broadcast_that_is_no_revoke_or_aimed_elsewhere_is_not_taken(clean_redis: EmbeddedRedis) -> None:
    listener = revokes.listen(app, Settings())
    assert listener is not None
    try:
        app.control.revoke("for-a-worker", destination=["worker0@host"])
        with app.connection_for_write() as conn:  # a connection of its own: no other test's pool state
            app.control.ping(timeout=0.1, connection=conn)
        app.control.revoke("for-everyone")
        assert first_heard(listener, "the broadcast revoke heard") == ["for-everyone"]
    finally:
        listener.stop()


def test_revokes_are_recorded_in_redis_for_processes_that_start_later(clean_redis: EmbeddedRedis) -> None:
    import redis

    from carpool.redis_edge.keys import Keys
    from carpool.redis_edge.store import RequestStore

    client = redis.Redis.from_url(clean_redis.url())
    store = RequestStore(client, Keys("carpool.requests"), 30)
    store.remember_revoked(["old"], 1000.0, keep_s=100, keep=3)
    store.remember_revoked(["a", "b"], 1050.0, keep_s=100, keep=3)
    store.remember_revoked(["c", "d"], 1101.0, keep_s=100, keep=3)  # "old" is past 100 s; 3 kept
    assert sorted(store.revoked_since(0)) == [("b", 1050.0), ("c", 1101.0), ("d", 1101.0)]
    assert sorted(store.revoked_since(1100)) == [("c", 1101.0), ("d", 1101.0)]
    store.remember_revoked(["c"], 1102.0, keep_s=100, keep=3)  # heard again: its first time stays
    assert ("c", 1101.0) in store.revoked_since(None)
    store.remember_revoked(["e"], 5000.0, keep_s=0, keep=0)  # Celery's 0: no limit, nothing trimmed
    assert len(store.revoked_since(None)) == 4

    client.flushdb()
    first = revokes.Revoked(store)
    first.remember(["heard-by-the-first"])
    later = revokes.Revoked(store)  # a coordinator started afterwards
    assert "heard-by-the-first" not in later
    assert later.load() == 1 and "heard-by-the-first" in later


def test_a_coordinator_started_before_its_redis_hears_revokes_once_redis_is_up() -> None:
    """Found by the ops review: a coordinator that met no Redis at start logged "cannot hear
    revokes" once and served for the rest of its life without listening, so a request revoked
    while it held it ran and answered SUCCESS. It now waits for Redis before taking any."""
    from carpool.celery_edge.app import create_app
    from carpool.config import load_settings
    from carpool.redis_edge.keys import Keys
    from carpool.tools.embedded import free_port
    from carpool.tools.harness import Harness, release_result_consumer

    port = free_port()
    url = f"redis://127.0.0.1:{port}"
    server = EmbeddedRedis(port=port)
    producer = create_app(load_settings(broker_url=f"{url}/0", result_backend=f"{url}/1"))
    try:
        with Harness(broker_url=f"{url}/0", result_backend=f"{url}/1") as h:
            coordinator = h.start("coordinator", "coordinator", CARPOOL_MODEL="toy")
            # Until its first try at subscribing met no Redis (kombu retries a connection a while).
            wait_for(
                "the coordinator's subscription refused",
                lambda: any(s in h.log("coordinator") for s in ("until it answers", "cannot hear revokes")),
                timeout_s=120,
            )
            server.start()
            h.wait_coordinator(coordinator.pid, timeout_s=60)
            held = producer.send_task(
                "carpool.infer", args=("held: no worker runs",), kwargs={"model": "toy"}
            )
            leases = Keys("carpool.requests").inflight_lease
            wait_for("the request held", lambda: h.redis_client().zcard(leases) == 1)
            held.revoke()
            assert wait_for("the revoke heard", lambda: held.state == "REVOKED", timeout_s=20)
    finally:
        release_result_consumer(producer)
        server.cleanup()

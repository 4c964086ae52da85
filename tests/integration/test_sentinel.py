"""Redis failover under Sentinel, with real processes: a master, a replica, three Sentinels.

A producer sends requests one at a time through the Sentinel URLs while a coordinator and a worker
batch them. Then the replica is cut off the master's writes for half a second (as a broken or slow
link would leave it behind), the master is killed with SIGKILL, the Sentinels promote the replica, the old
master comes back as a replica of the new one (once it has synced), and the producer keeps sending; in
one run the new master then stalls and the Sentinels fail over a second time. Every request whose
send returned must end with its right result on the new master: with ``CARPOOL_WAIT_REPLICAS=1``
that is asserted (the sends in the lag raise NotReplicated); with 0 (asynchronous replication)
what was lost is counted and recorded.
"""

from __future__ import annotations

import os
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from carpool.celery_edge.app import create_app
from carpool.config import load_settings
from carpool.errors import NotReplicated
from carpool.producer.submit import submit_many
from carpool.redis_edge.connect import client_for
from carpool.redis_edge.keys import Keys
from carpool.tools.embedded import SentinelGroup
from carpool.tools.harness import Harness, release_result_consumer
from carpool.tools.workload import mixed_texts
from tests.integration.conftest import wait_for
from tests.integration.models import SLOW
from tests.integration.test_reliability import expected, record
from tests.tolerances import VECTOR_ATOL

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MASTER = "carpool-test"
RECOVERY_S = 3.0
ENV = {
    "CARPOOL_MODEL": SLOW,
    "CARPOOL_MAX_BATCH": "8",
    "CARPOOL_RECOVERY_TIMEOUT_S": str(RECOVERY_S),
    "CARPOOL_SENTINEL_MASTER": MASTER,
    "CARPOOL_WAIT_TIMEOUT_S": "0.5",
    "SLOW_TOY_DELAY_S": "0.05",
    # A second failover on a loaded host can take most of a minute: what is measured here is loss,
    # not the default deadline's DeadlineExceeded for requests that outlived it meanwhile.
    "CARPOOL_DEFAULT_DEADLINE_S": "600",
}
BEFORE_KILL_S = 2.0  # sending before the master dies
LAG_S = 0.5  # of those, the last ones with the replica cut off (under the Sentinels' 1 s down-after)
AFTER_RETURN_S = 2.0  # sending once the old master is back, as a replica
PACE_S = 0.005  # between two sends
KEYS = Keys("carpool.requests")


def run_failover(
    tmp_path: Path, wait_replicas: int, after_rejoin: Callable[[SentinelGroup], None] | None = None
) -> dict[str, Any]:
    """One run; returns what happened to the requests sent (ids of those accepted, and counts).
    ``after_rejoin(group)`` runs once the old master is back as a replica, while the producer waits."""
    env = {**ENV, "CARPOOL_WAIT_REPLICAS": str(wait_replicas)}
    with SentinelGroup(MASTER) as group:
        settings = load_settings(
            broker_url=group.url(0),
            result_backend=group.url(1),
            sentinel_master=MASTER,
            wait_replicas=wait_replicas,
            wait_timeout_s=0.5,
        )
        app = create_app(settings)
        base_env = {**os.environ, **env}
        with Harness(
            broker_url=group.url(0), result_backend=group.url(1), log_dir=tmp_path, base_env=base_env
        ) as h:
            try:
                h.start_stack(1)
                return _produce_through_failover(group, h, app, settings, after_rejoin)
            finally:
                release_result_consumer(app)


def _produce_through_failover(
    group: SentinelGroup,
    h: Harness,
    app: Any,
    settings: Any,
    after_rejoin: Callable[[SentinelGroup], None] | None,
) -> dict[str, Any]:
    texts = iter(mixed_texts(5000, seed=14))
    accepted: dict[str, str] = {}  # id -> text of every request whose send returned
    unconfirmed: dict[str, str] = {}  # sent, but NotReplicated: on the master, maybe not on a replica
    failed: Counter[str] = Counter()

    def send() -> None:
        text = next(texts)
        try:
            (result,) = submit_many([text], model=SLOW, app=app, subscribe=False)
            accepted[result.id] = text
        except NotReplicated as exc:
            unconfirmed.update((r.id, text) for r in exc.results)
        except (redis.RedisError, OSError) as exc:
            failed[type(exc).__name__] += 1
            time.sleep(0.05)
        time.sleep(PACE_S)

    end = time.monotonic() + BEFORE_KILL_S - LAG_S
    while time.monotonic() < end:
        send()
    group.cut_replica()
    end = time.monotonic() + LAG_S
    while time.monotonic() < end:
        send()
    with client_for(group.url(0), settings) as broker:
        at_kill = {"queued": _queued(broker), "in_flight": int(broker.zcard(KEYS.inflight_lease))}
    group.kill_master()
    t_kill = time.monotonic()
    while group.master_port() != group.replica.port:
        send()
        assert time.monotonic() - t_kill < 30, "the Sentinels did not promote the replica"
    promoted_s = time.monotonic() - t_kill
    while not group.failover_complete():  # what a restarted server must wait for (see its docstring)
        send()
        assert time.monotonic() - t_kill < 60, f"the failover did not complete: {group.describe()}"
    group.rejoin()
    if after_rejoin is not None:
        after_rejoin(group)
    end = time.monotonic() + AFTER_RETURN_S
    while time.monotonic() < end:
        send()
    _wait_answered(group, settings, [*accepted, *unconfirmed])
    done_s = time.monotonic() - t_kill
    with client_for(group.url(1), settings) as results_db:
        keys = [app.backend.get_key_for_task(i) for i in accepted]
        stored = dict(zip(accepted, results_db.mget(keys), strict=True))
        unconfirmed_keys = [app.backend.get_key_for_task(i) for i in unconfirmed]
        unconfirmed_answered = (
            sum(v is not None for v in results_db.mget(unconfirmed_keys)) if unconfirmed else 0
        )
    lost = [i for i, raw in stored.items() if raw is None]
    right, not_right = _right_results(app, {i: raw for i, raw in stored.items() if raw is not None}, accepted)
    h.check_alive()
    return {
        "accepted": len(accepted),
        "unconfirmed": len(unconfirmed),
        "unconfirmed_answered": unconfirmed_answered,
        "replica_lag_s": LAG_S,
        "send_errors": dict(failed),
        "lost": len(lost),
        "right": right,
        "not_right": not_right,
        "answered": len(stored) - len(lost),
        "promoted_after_s": round(promoted_s, 2),
        "all_done_after_kill_s": round(done_s, 2),
        **{f"{k}_at_kill": v for k, v in at_kill.items()},
    }


def _queued(client: redis.Redis) -> int:
    return sum(int(client.llen(k)) for k in KEYS.request_lists)


def _wait_answered(group: SentinelGroup, settings: Any, ids: list[str], timeout_s: float = 60) -> None:
    """Wait until nothing is queued or in flight on the new master: every request answered, or lost
    for good."""
    with client_for(group.url(0), settings) as broker:

        def settled() -> bool:
            try:
                return _queued(broker) == 0 and int(broker.zcard(KEYS.inflight_lease)) == 0
            except redis.ConnectionError:
                return False

        wait_for(f"{len(ids)} requests settled", settled, timeout_s)


def _right_results(app: Any, stored: dict[str, bytes], texts: dict[str, str]) -> tuple[int, dict[str, int]]:
    """How many stored results are the right vectors, and what the others were (for the record)."""
    ids = list(stored)
    want = expected([texts[i] for i in ids])
    right = 0
    other: Counter[str] = Counter()
    for task_id, w in zip(ids, want, strict=True):
        meta = app.backend.decode_result(stored[task_id])
        if meta["status"] != "SUCCESS":
            exc = meta.get("result")
            other[f"{meta['status']} {exc.get('exc_type') if isinstance(exc, dict) else ''}".strip()] += 1
        elif np.allclose(meta["result"], w, atol=VECTOR_ATOL):
            right += 1
        else:
            other["a wrong vector"] += 1
    return right, dict(other)


def test_failover_with_wait_loses_no_accepted_request(tmp_path: Path) -> None:
    outcome = run_failover(tmp_path, wait_replicas=1)
    record("kill -9 the Redis master under Sentinel, CARPOOL_WAIT_REPLICAS=1", **outcome)
    assert outcome["accepted"] > 100, outcome
    assert outcome["lost"] == 0, outcome
    assert outcome["right"] == outcome["accepted"], outcome


def _stall_new_master_until_failed_over(group: SentinelGroup) -> None:
    """Freeze the promoted master past the Sentinels' down-after (a host stalled under load would),
    so that they fail over again, onto the old master that has just rejoined."""
    stalled, rejoined = group.master, group.replica
    assert stalled.process is not None
    os.kill(stalled.process.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while group.master_port() != rejoined.port:
            assert time.monotonic() < deadline, "the Sentinels did not fail over a second time"
            time.sleep(0.05)
    finally:
        os.kill(stalled.process.pid, signal.SIGCONT)
    group.master, group.replica = rejoined, stalled


def test_second_failover_onto_the_rejoined_master_loses_no_accepted_request(tmp_path: Path) -> None:
    """Right after the first failover the new master stalls and the Sentinels promote the old one,
    which rejoined a moment before: what it held by then (every WAITed write) is all there is."""
    outcome = run_failover(tmp_path, wait_replicas=1, after_rejoin=_stall_new_master_until_failed_over)
    record("kill -9 the master, then stall the promoted one: a second failover", **outcome)
    assert outcome["accepted"] > 100, outcome
    assert outcome["lost"] == 0, outcome
    assert outcome["right"] == outcome["accepted"], outcome


def test_failover_without_wait_counts_what_it_loses(tmp_path: Path) -> None:
    outcome = run_failover(tmp_path, wait_replicas=0)
    record("kill -9 the Redis master under Sentinel, CARPOOL_WAIT_REPLICAS=0", **outcome)
    assert outcome["accepted"] > 100, outcome
    # Asynchronous replication may lose what the master had not yet sent to the replica; whatever
    # survived must be right.
    assert outcome["right"] == outcome["answered"], outcome


def test_without_enough_replicas_the_producer_is_told(clean_redis: Any) -> None:
    """On a server with no replica, WAIT 1 cannot be met: the direct publish, submit_many and the
    Celery path each raise NotReplicated carrying the results of what was sent (it is queued)."""
    import carpool.tasks  # noqa: F401  (registers carpool.infer on every app)

    settings = load_settings(
        broker_url=clean_redis.url(0), result_backend=clean_redis.url(1), wait_replicas=1, wait_timeout_s=0.05
    )
    app = create_app(settings)
    client = redis.Redis(port=clean_redis.port)
    try:
        with pytest.raises(NotReplicated, match="CARPOOL_WAIT_REPLICAS=1") as direct:
            submit_many(["a", "b"], model="toy", app=app, subscribe=False)
        assert len(direct.value.results) == 2
        with pytest.raises(NotReplicated) as chunked:
            submit_many(["c", "d", "e"], model="toy", app=app, subscribe=False, chunk_size=2)
        assert len(chunked.value.results) == 2  # the first chunk was sent; the rest were not
        assert client.llen(KEYS.request_queue) == 4
        task = app.tasks["carpool.infer"]
        with pytest.raises(NotReplicated) as celery_path:
            task.apply_async(("f",), countdown=60)  # countdown: Celery's own publish, then the fence
        assert [r.id for r in celery_path.value.results] and client.llen(KEYS.request_queue) == 5
    finally:
        release_result_consumer(app)
        client.close()


def test_scripts_reload_on_a_server_that_lacks_them(clean_redis: Any) -> None:
    """A promoted replica may not have the scripts cached: script_then_wait loads them again."""
    from carpool.redis_edge import lua
    from carpool.redis_edge.replication import script_then_wait

    client = redis.Redis(port=clean_redis.port)
    try:
        script = lua.register(client, "heartbeat")
        client.script_flush()
        reply, acked = script_then_wait(client, script, [KEYS.workers], ["w1", 1000], 0, 0.01)
        assert int(reply) == 1 and acked == 0
        client.script_flush()
        assert int(script(keys=[KEYS.workers], args=["", 0])) == 1  # redis-py's Script does the same
    finally:
        client.close()


def test_a_rejoining_master_is_not_promoted_before_its_first_sync() -> None:
    """The killed master comes back empty; the promoted one stalls before the two have synced (Redis
    7 waits 5 s before a diskless sync). The Sentinels try to fail over and find no replica they may
    promote (it starts with replica-priority 0): the data stays on the stalled master, and once it
    resumes the rejoined server syncs it and may be promoted from then on."""
    with SentinelGroup(MASTER) as group:
        with redis.Redis(port=group.master.port) as master:
            master.set("kept", "yes")
            assert master.wait(1, 5000) == 1
        group.kill_master()
        group.wait_promoted()
        deadline = time.monotonic() + 60
        while not group.failover_complete():
            assert time.monotonic() < deadline, f"the failover did not complete: {group.describe()}"
            time.sleep(0.05)
        group.restart_old_master()
        stalled, rejoined = group.master, group.replica
        with redis.Redis(port=rejoined.port) as replica:
            assert replica.info("replication")["master_link_status"] == "down"  # not synced yet
        assert stalled.process is not None
        os.kill(stalled.process.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 30
            while not _sentinels_logged(group, "-failover-abort-no-good-slave"):
                assert group.master_port() == stalled.port, (
                    f"the empty server was promoted: {group.describe()}"
                )
                assert time.monotonic() < deadline, f"no failover was tried: {group.describe()}"
                time.sleep(0.05)
        finally:
            os.kill(stalled.process.pid, signal.SIGCONT)
        group.wait_rejoined()
        assert group.master_port() == stalled.port
        with redis.Redis(port=rejoined.port) as replica:
            assert replica.get("kept") == b"yes"
            assert int(replica.config_get("replica-priority")["replica-priority"]) == 100


def _sentinels_logged(group: SentinelGroup, event: str) -> bool:
    return any(event in Path(group.sentinel_log(port)).read_text() for port in group.sentinel_ports)

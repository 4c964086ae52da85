"""What a coordinator and a worker check of their Redis server at start (``connect.check_server``):
a server too old or a results database it lacks stops them; an evicting memory policy is an error
in their logs. Against a real redis-server."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import redis

from carpool.errors import ConfigError
from carpool.redis_edge.connect import check_server
from carpool.tools.embedded import EmbeddedRedis


def test_a_server_as_carpool_needs_it_passes_silently(
    clean_redis: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    broker, results = redis.Redis(port=clean_redis.port, db=0), redis.Redis(port=clean_redis.port, db=1)
    with caplog.at_level(logging.WARNING, logger="carpool"):
        check_server(broker, results, "coordinator")
    assert caplog.records == []


def test_an_evicting_memory_policy_is_logged_as_an_error_naming_the_fix(
    clean_redis: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    # With allkeys-lru (or volatile-lru, the default of managed services) Redis under pressure
    # evicted the in-flight keys and stored results: requests vanished without a log line.
    broker = redis.Redis(port=clean_redis.port)
    before = {k: str(v) for k, v in broker.config_get("maxmemory*").items()}
    broker.config_set("maxmemory-policy", "volatile-lru")
    try:
        with caplog.at_level(logging.WARNING, logger="carpool"):
            check_server(broker, None, "worker")  # no memory limit: eviction would start with one
            broker.config_set("maxmemory", "512mb")
            check_server(broker, None, "worker")
    finally:
        broker.config_set("maxmemory", before["maxmemory"])
        broker.config_set("maxmemory-policy", before["maxmemory-policy"])
    unlimited, limited = caplog.records
    assert unlimited.levelno == logging.WARNING and "once a maxmemory is set" in unlimited.getMessage()
    assert limited.levelno == logging.ERROR
    message = limited.getMessage()
    assert "worker: the Redis at CARPOOL_BROKER_URL has maxmemory-policy volatile-lru" in message
    assert "when it reaches maxmemory" in message and "set maxmemory-policy noeviction" in message


def test_a_results_server_of_its_own_is_checked_for_eviction_too(
    clean_redis: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """A results-only Redis is the one most often run as a cache, evicting least recently used keys."""
    with EmbeddedRedis() as other:
        results = redis.Redis(port=other.port, db=1)
        results.config_set("maxmemory", "512mb")
        results.config_set("maxmemory-policy", "allkeys-lru")
        with caplog.at_level(logging.WARNING, logger="carpool"):
            check_server(redis.Redis(port=clean_redis.port), results, "coordinator")
    [record] = caplog.records
    assert "the Redis at CARPOOL_RESULT_BACKEND has maxmemory-policy allkeys-lru" in record.getMessage()
    assert "stored results" in record.getMessage()


def test_a_results_database_the_server_lacks_stops_the_process_at_start(clean_redis: EmbeddedRedis) -> None:
    # It was met only when a result was first stored: the worker re-ran its batch on every lease.
    broker = redis.Redis(port=clean_redis.port)
    databases = int(str(broker.config_get("databases")["databases"]))
    with pytest.raises(ConfigError, match=r"no such database.*CARPOOL_RESULT_BACKEND must name"):
        check_server(broker, redis.Redis(port=clean_redis.port, db=databases), "worker")


class _Old:
    """A client of a Redis older than carpool's scripts need (none is installed here to start)."""

    def info(self, section: str) -> dict[str, Any]:
        return {"redis_version": "6.0.16"} if section == "server" else {"maxmemory_policy": "noeviction"}


def test_a_redis_older_than_6_2_stops_the_process_at_start_naming_the_version() -> None:
    with pytest.raises(ConfigError, match=r"Redis 6\.0\.16 at CARPOOL_BROKER_URL is too old.*6\.2 or newer"):
        check_server(_Old(), None, "coordinator")


def test_an_unreachable_server_or_one_refusing_info_is_passed_over() -> None:
    """The process retries as it runs; a server that renamed INFO away cannot be checked."""
    check_server(redis.Redis(port=1, socket_connect_timeout=0.2), None, "coordinator")


@pytest.mark.parametrize("role", ["coordinator", "worker"])
@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ("CARPOOL_RESULT_BACKEND", "no such database"),
        # The worker's Celery consumer retried this one for ever (found by the docs and ops reviews).
        ("CARPOOL_BROKER_URL", "no such database"),
        # The worker stopped with a traceback and exit status 1 (the ops review).
        ("CARPOOL_MODEL", "model 'nosuch.mod:Cls' cannot be imported"),
    ],
)
def test_a_coordinator_and_a_worker_check_their_settings_and_server_at_start(
    processes: Any, role: str, setting: str, said: str
) -> None:
    from tests.integration.conftest import server_of

    port = server_of(processes).port
    value = "nosuch.mod:Cls" if setting == "CARPOOL_MODEL" else f"redis://127.0.0.1:{port}/99"
    proc = processes.start(role, role, **{setting: value})
    assert proc.wait(timeout=60) == 2, "a configuration error, seen by the supervisor"
    log = (processes.log_dir / f"{role}.log").read_text(errors="replace")
    assert said in log and (setting in log or "CARPOOL_MODEL" in log), log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_keys_evicted_while_a_coordinator_runs_are_an_error_in_its_log(
    clean_redis: EmbeddedRedis, caplog: pytest.LogCaptureFixture
) -> None:
    # A maxmemory set after the start check (CONFIG SET, a managed service's resize): the only
    # trace of the lost requests was workers' INFO lines calling them reaped (review, 2026-12-06).
    from carpool.redis_edge.connect import EvictionWatch

    broker = redis.Redis(port=clean_redis.port)
    before = {k: str(v) for k, v in broker.config_get("maxmemory*").items()}
    watch = EvictionWatch("coordinator", "CARPOOL_BROKER_URL")
    try:
        with caplog.at_level(logging.WARNING, logger="carpool"):
            assert watch.check(broker) == 0  # the first look: the count to compare with
            broker.config_set("maxmemory-policy", "allkeys-lru")
            broker.config_set("maxmemory", int(broker.info("memory")["used_memory"]) + 512 * 1024)
            for i in range(64):
                broker.set(f"evict-me-{i}", b"x" * 32 * 1024)
            assert not caplog.records
            evicted = watch.check(broker)
            assert evicted > 0 and watch.check(broker) == 0, "each eviction told once"
    finally:
        broker.config_set("maxmemory", before["maxmemory"])
        broker.config_set("maxmemory-policy", before["maxmemory-policy"])
        broker.flushdb()
    [record] = caplog.records
    assert record.levelno == logging.ERROR
    message = record.getMessage()
    assert f"coordinator: the Redis at CARPOOL_BROKER_URL evicted {evicted} keys" in message
    assert "maxmemory-policy allkeys-lru" in message and "set maxmemory-policy noeviction" in message

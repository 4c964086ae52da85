from __future__ import annotations

import pytest

from carpool.config import Settings, load_settings
from carpool.errors import ConfigError


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in [n for n in os.environ if n.startswith("CARPOOL_")]:
        monkeypatch.delenv(name)
    s = Settings()
    assert s.broker_url == "redis://localhost:6379/0"
    assert s.result_backend == "redis://localhost:6379/1"
    assert s.request_queue == "carpool.requests"
    assert s.model == "minilm"
    assert s.policy == "binned"


@pytest.mark.parametrize(
    ("request_queue", "batch_queue", "expected"),
    [
        ("carpool.requests", None, "carpool.batches"),
        ("app_a.requests", None, "app_a.batches"),
        ("jobs", None, "jobs.batches"),
        ("app_a.requests", "gpu.batches", "gpu.batches"),
    ],
)
def test_the_batch_queue_follows_the_request_queue_unless_set(
    monkeypatch: pytest.MonkeyPatch, request_queue: str, batch_queue: str | None, expected: str
) -> None:
    """Two deployments sharing a database with their own request queues and the default batch
    queue ran each other's batches and answered nothing."""
    monkeypatch.delenv("CARPOOL_BATCH_QUEUE", raising=False)
    monkeypatch.setenv("CARPOOL_REQUEST_QUEUE", request_queue)
    if batch_queue is not None:
        monkeypatch.setenv("CARPOOL_BATCH_QUEUE", batch_queue)
    assert load_settings().batch_queue == expected


def test_environment_with_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CARPOOL_MAX_BATCH", "64")
    monkeypatch.setenv("CARPOOL_BIN_EDGES", "8, 24,100")
    monkeypatch.setenv("CARPOOL_MODEL", "toy")
    monkeypatch.setenv("CARPOOL_MODELS", "toy,null")
    s = load_settings()
    assert s.max_batch == 64
    assert s.bin_edges == (8, 24, 100)
    assert s.served_models == ("toy", "null")


@pytest.mark.parametrize(
    ("var", "value", "needle"),
    [
        ("CARPOOL_MAX_BATCH", "0", "greater than or equal to 1"),
        ("CARPOOL_MAX_BATCH", "many", "valid integer"),
        ("CARPOOL_BIN_EDGES", "64,16", "strictly increasing"),
        ("CARPOOL_BIN_EDGES", "a,b", "comma-separated integers"),
        ("CARPOOL_POLICY", "random", "'binned', 'fifo' or 'shortest'"),
        ("CARPOOL_BROKER_URL", "amqp://x", "redis://"),
        ("CARPOOL_BROKER_URL", "unix://localhost/run/redis.sock", "names a path, not a host"),
        ("CARPOOL_RESULT_BACKEND", "redis+socket://run/redis.sock", "names a path, not a host"),
        ("CARPOOL_RESULT_BACKEND", "unix:///run/redis.sock?db=1&virtual_host=2", "more than one database"),
        ("CARPOOL_BROKER_URL", "redis+socket:///run/redis.sock?timeout=3", "not ['timeout']"),
        ("CARPOOL_BROKER_URL", "redis+socket:///run/redis.sock?virtual_host=zero", "must be a number"),
        ("CARPOOL_MODEL", "no such model", "package.module:ClassName"),
        ("CARPOOL_RECOVERY_TIMEOUT_S", "600", "less than or equal to 60"),
        # A worker renews its leases every second: shorter ones ran out under it (reruns).
        ("CARPOOL_RECOVERY_TIMEOUT_S", "0.005", "greater than or equal to 2"),
        # Redis refuses such an expiry at every store: results never stored, producers waiting.
        ("CARPOOL_RESULT_EXPIRES_S", "10000000000000000", "less than or equal to 315360000"),
        # Both failed only at the first connection (a traceback), or at the first .delay().
        ("CARPOOL_BROKER_URL", "redis://127.0.0.1:99999/0", "port is not a port number"),
        (
            "CARPOOL_RESULT_BACKEND",
            "redis://127.0.0.1:6379/abc",
            "by its number (redis://host:6379/1), not 'abc'",
        ),
        # kombu hands a db= query on to the connection, which refuses it at the first publish.
        ("CARPOOL_BROKER_URL", "redis://127.0.0.1:6379?db=1", "in the URL's path (redis://host:6379/1)"),
        ("CARPOOL_RESULT_BACKEND", "rediss://h:6380/?ssl_cert_reqs=none&db=2", "not as ?db="),
        # kombu hands other query options to redis-py's connection as they are, which refuses them
        # (or their strings) at the first .delay(); the coordinator failed every step with it.
        ("CARPOOL_BROKER_URL", "redis://h:6379/0?socket_timeout=5", "CARPOOL_REDIS_SOCKET_TIMEOUT_S"),
        (
            "CARPOOL_RESULT_BACKEND",
            "redis://h:6379/1?max_connections=5",
            "?max_connections= is not an option",
        ),
        ("CARPOOL_BROKER_URL", "redis://h:6379/0?ssl_cert_reqs=required", "use rediss:// for TLS"),
        # Celery's result backend refuses these at the app's first use, in every process, with a traceback.
        ("CARPOOL_RESULT_BACKEND", "rediss://h:6380/1", "needs ?ssl_cert_reqs=required"),
        ("CARPOOL_BROKER_URL", "rediss://h:6380/0?ssl_cert_reqs=bogus", "?ssl_cert_reqs=bogus is not one of"),
        # Celery's spelling, which redis-py (carpool's own clients) refuses at the first connection.
        (
            "CARPOOL_RESULT_BACKEND",
            "rediss://h:6380/1?ssl_cert_reqs=CERT_REQUIRED",
            "for CERT_REQUIRED write",
        ),
        # redis-py reads no host as localhost: what a template with an unset $REDIS_HOST writes.
        ("CARPOOL_BROKER_URL", "redis://:6379/0", "names no host"),
        ("CARPOOL_RESULT_BACKEND", "redis://:secret@/1", "names no host"),
    ],
)
def test_bad_values_name_the_setting(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, needle: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError) as err:
        load_settings()
    message = str(err.value)
    assert var in message or (var == "CARPOOL_MODEL" and "CARPOOL_MODEL" in message)
    assert needle in message


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        # redis-py's spelling becomes kombu's and Celery's, with the database always named
        ("unix:///run/redis.sock?db=2", "redis+socket:///run/redis.sock?virtual_host=2"),
        ("redis+socket:///run/redis.sock", "redis+socket:///run/redis.sock?virtual_host=0"),
        ("socket:///run/redis.sock?virtual_host=1", "redis+socket:///run/redis.sock?virtual_host=1"),
        ("unix://:s%40cret@/run/redis.sock?db=1", "redis+socket://:s%40cret@/run/redis.sock?virtual_host=1"),
        ("unix:///run/redis.sock?password=pw", "redis+socket://:pw@/run/redis.sock?virtual_host=0"),
        (
            "redis+socket://app:pw@/run/redis.sock?virtual_host=3",
            "redis+socket://app:pw@/run/redis.sock?virtual_host=3",
        ),
    ],
)
def test_a_unix_socket_url_is_kept_in_the_form_celery_and_kombu_read(given: str, kept: str) -> None:
    settings = load_settings(broker_url=given, result_backend=given)
    assert settings.broker_url == settings.result_backend == kept


def test_automatic_bin_edges(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CARPOOL_BIN_EDGES", "auto")
    s = load_settings()
    assert s.auto_bins == 6 and s.bin_edges == (16, 32, 48, 64, 96, 128, 192)


def test_tight_backlog_is_on_by_default_and_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from carpool.coordinator import policy_config

    monkeypatch.delenv("CARPOOL_TIGHT_BACKLOG", raising=False)
    assert policy_config(load_settings()).tight_backlog is True
    monkeypatch.setenv("CARPOOL_TIGHT_BACKLOG", "false")
    assert policy_config(load_settings()).tight_backlog is False


def test_a_wait_for_replicas_must_end_before_the_socket_gives_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """A WAIT outlasting the socket timeout reads as a dead connection and is sent again."""
    monkeypatch.setenv("CARPOOL_WAIT_REPLICAS", "1")
    monkeypatch.setenv("CARPOOL_WAIT_TIMEOUT_S", "3")
    monkeypatch.setenv("CARPOOL_REDIS_SOCKET_TIMEOUT_S", "3.5")
    with pytest.raises(ConfigError, match=r"CARPOOL_WAIT_TIMEOUT_S \(3\) must stay at least 1 s under"):
        load_settings()
    monkeypatch.setenv("CARPOOL_REDIS_SOCKET_TIMEOUT_S", "4")
    assert load_settings().wait_timeout_s == 3
    monkeypatch.setenv("CARPOOL_WAIT_REPLICAS", "0")  # no WAIT is sent
    monkeypatch.setenv("CARPOOL_REDIS_SOCKET_TIMEOUT_S", "2")
    assert load_settings().redis_socket_timeout_s == 2


def test_an_unknown_model_name_lists_every_builtin_one() -> None:
    from carpool.models import BUILTIN

    with pytest.raises(ConfigError) as raised:
        load_settings(model="no such model")
    for name in BUILTIN:  # sim-v100 and sim-h100 included: the README names them
        assert name in str(raised.value)


@pytest.mark.parametrize(
    "url",
    [
        "redis://:s3cretpw@redis:abc/0",
        "redis://user:s3cretpw@redis:6379/results",
        "redis://:s3cretpw@redis:6379/0?db=1",
        "sentinel://:s3cretpw@s1:26379;sentinel://:s3cretpw2@s2:26379/0",  # credentials that differ
    ],
)
def test_a_settings_error_never_shows_a_password(url: str) -> None:
    # The message goes to stderr, and from there to docker's or journald's logs.
    with pytest.raises(ConfigError) as raised:
        load_settings(broker_url=url, sentinel_master="m", sentinel_password="s3cretpw", max_batch=0)
    assert "CARPOOL_BROKER_URL" in str(raised.value) and "s3cretpw" not in str(raised.value)


def test_a_settings_error_names_the_variable_once_with_every_value_it_takes() -> None:
    with pytest.raises(ConfigError) as raised:
        load_settings(events="on2")
    [line] = str(raised.value).splitlines()[1:]
    assert line.startswith("  CARPOOL_EVENTS: Input should be a valid boolean")
    assert "; or Input should be 'auto' (got 'on2')" in line


def test_a_misspelled_setting_is_named_with_the_one_it_nearly_is(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from carpool import config

    monkeypatch.setattr(config, "_WARNED", set())

    environ = {"CARPOOL_MAX_BACH": "4", "CARPOOL_SIM_DEVICE": "v100", "CARPOOL_MY_APP_FLAG": "1"}
    with caplog.at_level("WARNING", logger="carpool.config"):
        config._warn_misspelled(environ)
        config._warn_misspelled(environ)  # settings loaded again: said once
    assert [r.getMessage() for r in caplog.records] == [
        "CARPOOL_MAX_BACH is not a carpool setting and is ignored: did you mean CARPOOL_MAX_BATCH?"
    ]


def test_a_tls_url_keeps_the_certificate_options_celery_and_kombu_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = "rediss://:pw@h:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/etc/ca.pem"
    monkeypatch.setenv("CARPOOL_BROKER_URL", url)
    assert load_settings().broker_url == url

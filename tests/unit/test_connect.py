"""The Redis client factory and the Sentinel settings: URL parsing, no connection made."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio
from redis.sentinel import SentinelConnectionPool

from carpool.celery_edge.app import create_app
from carpool.config import load_settings
from carpool.errors import ConfigError
from carpool.redis_edge.connect import (
    async_client_for,
    client_for,
    is_sentinel,
    is_socket,
    parse_sentinel,
    server_and_db,
    transport_options,
)
from carpool.redis_edge.socket_options import async_client_options, client_options

THREE = "sentinel://h1:26379;sentinel://h2:26380;sentinel://h3/1"


def test_parse_reads_every_address_and_the_database_wherever_it_is_written() -> None:
    parsed = parse_sentinel(THREE)
    assert parsed.sentinels == (("h1", 26379), ("h2", 26380), ("h3", 26379))
    assert parsed.db == 1
    assert (parsed.username, parsed.password) == (None, None)


def test_the_rewritten_url_carries_database_and_credentials_on_every_address() -> None:
    # kombu and Celery read both from the first address only.
    parsed = parse_sentinel("sentinel://h1;sentinel://:p%40ss@h2:26380/3")
    assert parsed.password == "p@ss"
    assert parsed.url() == "sentinel://:p%40ss@h1:26379/3;sentinel://:p%40ss@h2:26380/3"
    assert parse_sentinel(parsed.url()) == parsed


@pytest.mark.parametrize(
    "url",
    [
        "sentinel://h1/0;sentinel://h2/1",  # two databases
        "sentinel://:a@h1;sentinel://:b@h2",  # two passwords
        "sentinel://h1;redis://h2",  # not a sentinel address
        "sentinel://h1/x",  # not a database number
        "sentinel://h1:notaport",
    ],
)
def test_ambiguous_or_malformed_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError):
        parse_sentinel(url)


def test_settings_accept_sentinel_urls_only_with_the_master_name(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="CARPOOL_SENTINEL_MASTER"):
        load_settings(broker_url=THREE)
    monkeypatch.setenv("CARPOOL_SENTINEL_MASTER", "mymaster")
    settings = load_settings(broker_url=THREE.replace("/1", "/0"), result_backend=THREE)
    assert settings.broker_url.endswith("sentinel://h3:26379/0")
    assert settings.broker_url.startswith("sentinel://h1:26379/0;")
    with pytest.raises(ConfigError, match="CARPOOL_BROKER_URL"):
        load_settings(broker_url="sentinel://h1/0;sentinel://h2/1")


def test_sentinel_password_stays_out_of_the_settings_repr() -> None:
    settings = load_settings(sentinel_master="m", sentinel_password="s3cret")
    assert "s3cret" not in repr(settings)
    assert transport_options(settings) == {"master_name": "m", "sentinel_kwargs": {"password": "s3cret"}}


def test_one_master_means_one_server_for_the_worker_finish() -> None:
    settings = load_settings(
        broker_url="sentinel://h2:26380;sentinel://h1/0",
        result_backend=THREE.replace("h3", "h3"),
        sentinel_master="m",
    )
    assert settings.shared_server_dbs() is None  # h3 is not among the broker's Sentinels
    settings = load_settings(
        broker_url="sentinel://h1;sentinel://h2:26380/0",
        result_backend="sentinel://h2:26380;sentinel://h1/1",
        sentinel_master="m",
    )
    assert settings.shared_server_dbs() == (0, 1)
    mixed = load_settings(
        broker_url="sentinel://h1/0", result_backend="redis://h1:6379/1", sentinel_master="m"
    )
    assert mixed.shared_server_dbs() is None
    plain = load_settings(broker_url="redis://h:6379/0", result_backend="redis://h:6379/1")
    assert plain.shared_server_dbs() == (0, 1)
    assert server_and_db("redis://h:6379/2")[1] == 2


def test_plain_urls_give_plain_clients_with_the_options_passed_through() -> None:
    client = client_for("redis://h:6380/2", None, socket_timeout=3)
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["host"], kwargs["port"], kwargs["db"], kwargs["socket_timeout"]) == ("h", 6380, 2, 3)
    assert not is_sentinel("redis://h")


SOCKET = "redis+socket://:pw@/run/redis.sock?virtual_host=2"


def test_socket_urls_give_unix_socket_clients_without_tcp_options() -> None:
    from redis.connection import UnixDomainSocketConnection

    settings = load_settings(broker_url=SOCKET, result_backend=SOCKET)
    options = client_options(settings)
    assert options["socket_keepalive"] is True  # what a TCP client gets, and this one must not
    client = client_for(settings.broker_url, settings, **options)
    pool = client.connection_pool
    assert pool.connection_class is UnixDomainSocketConnection
    kwargs = pool.connection_kwargs
    assert (kwargs["path"], kwargs["db"], kwargs["password"]) == ("/run/redis.sock", 2, "pw")
    assert "socket_keepalive" not in kwargs
    assert kwargs["socket_timeout"] == settings.redis_socket_timeout_s
    pool.make_connection()  # builds the connection object (no connect): it takes these options
    aclient = async_client_for(settings.result_backend, settings, **async_client_options(settings))
    assert "socket_keepalive" not in aclient.connection_pool.connection_kwargs
    assert aclient.connection_pool.connection_kwargs["path"] == "/run/redis.sock"
    assert is_socket(SOCKET) and is_socket("unix:///x") and not is_socket("redis://h/0")


def test_a_socket_and_its_databases_are_one_server() -> None:
    same = load_settings(broker_url=SOCKET.replace("=2", "=0"), result_backend=SOCKET)
    assert same.shared_server_dbs() == (0, 2)
    other = load_settings(broker_url="redis+socket:///run/other.sock", result_backend=SOCKET)
    assert other.shared_server_dbs() is None


def test_the_celery_app_reaches_a_unix_socket_for_broker_and_backend() -> None:
    from redis.connection import UnixDomainSocketConnection

    settings = load_settings(broker_url=SOCKET.replace("=2", "=0"), result_backend=SOCKET)
    app = create_app(settings)
    backend = app.backend
    assert backend.connparams["connection_class"] is UnixDomainSocketConnection
    assert (backend.connparams["path"], int(backend.connparams["db"])) == ("/run/redis.sock", 2)
    assert "socket_keepalive" not in backend.connparams
    assert backend.connparams["socket_timeout"] == settings.redis_socket_timeout_s
    # kombu's broker connection is checked against a real socket in tests/integration/test_unix_socket.py
    assert app.conf.broker_url == settings.broker_url


def test_sentinel_urls_give_master_clients_of_the_named_master() -> None:
    settings = load_settings(
        broker_url=THREE, result_backend=THREE, sentinel_master="m", sentinel_password="sp"
    )
    client = client_for(settings.broker_url, settings, socket_timeout=3)
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    assert pool.service_name == "m" and pool.is_master
    assert pool.connection_kwargs["db"] == 1 and pool.connection_kwargs["socket_timeout"] == 3
    sentinels = pool.sentinel_manager.sentinels
    assert [
        (s.connection_pool.connection_kwargs["host"], s.connection_pool.connection_kwargs["port"])
        for s in sentinels
    ] == [
        ("h1", 26379),
        ("h2", 26380),
        ("h3", 26379),
    ]
    assert sentinels[0].connection_pool.connection_kwargs["password"] == "sp"
    assert isinstance(async_client_for(settings.broker_url, settings), redis.asyncio.Redis)
    with pytest.raises(ConfigError, match="CARPOOL_SENTINEL_MASTER"):
        client_for(THREE)


def test_the_celery_app_gets_the_master_name_for_broker_and_backend() -> None:
    from carpool.celery_edge.results import CarpoolSentinelBackend

    settings = load_settings(broker_url=THREE.replace("/1", "/0"), result_backend=THREE, sentinel_master="m")
    app = create_app(settings)
    broker_options = app.conf.broker_transport_options
    assert broker_options["master_name"] == "m" and broker_options["ack_emulation"] is False
    assert broker_options["socket_timeout"] == settings.redis_socket_timeout_s  # a dead peer is noticed
    assert app.conf.result_backend_transport_options == {"master_name": "m"}
    backend = app.backend
    assert isinstance(backend, CarpoolSentinelBackend)
    assert backend.connparams["db"] == 1
    assert [h["host"] for h in backend.connparams["hosts"]] == ["h1", "h2", "h3"]


def test_refused_credentials_name_the_settings_and_nothing_else_does() -> None:
    from kombu.exceptions import OperationalError

    from carpool.redis_edge.connect import refused_credentials

    refused = redis.AuthenticationError("invalid username-password pair or user is disabled.")
    hint = refused_credentials(refused, "CARPOOL_BROKER_URL")
    assert hint is not None and "invalid username-password pair" in hint
    assert "CARPOOL_BROKER_URL (redis://USER:PASSWORD@HOST:PORT/DB" in hint
    try:  # kombu's wrapping, as a publish raises it
        try:
            raise refused
        except redis.ConnectionError as exc:
            raise OperationalError(str(exc)) from exc
    except OperationalError as wrapped:
        assert refused_credentials(wrapped, "A", "B") == hint.replace("CARPOOL_BROKER_URL", "A and B")
    assert refused_credentials(redis.ConnectionError("Connection refused"), "CARPOOL_BROKER_URL") is None
    assert refused_credentials(ValueError("no"), "CARPOOL_BROKER_URL") is None


class _Pings:
    def __init__(self, error: Exception | None) -> None:
        self.error = error

    def ping(self) -> bool:
        if self.error is not None:
            raise self.error
        return True


@pytest.mark.parametrize(
    ("error", "answers"),
    [
        (None, True),
        (redis.ResponseError("NOPERM this user has no permissions to run the 'ping' command"), True),
        (redis.ConnectionError("Error 111 connecting"), False),
        # Something else answering on the port: the worker's check crashed on it with a traceback
        # (found by the review of the check), where Celery's consumer says so and retries.
        (redis.exceptions.InvalidResponse('Protocol error, got "<" as reply type byte'), False),
    ],
)
def test_database_answers_tells_an_answer_from_no_redis(error: Exception | None, answers: bool) -> None:
    from carpool.redis_edge.connect import database_answers

    assert database_answers(_Pings(error), "CARPOOL_BROKER_URL") is answers


def test_database_answers_stops_on_a_database_the_server_lacks() -> None:
    from carpool.redis_edge.connect import database_answers

    with pytest.raises(ConfigError, match=r"no such database.*CARPOOL_BROKER_URL must name"):
        database_answers(_Pings(redis.ResponseError("DB index is out of range")), "CARPOOL_BROKER_URL")


def test_sentinels_that_know_no_such_master_name_the_master_setting() -> None:
    from kombu.exceptions import OperationalError
    from redis.sentinel import MasterNotFoundError

    from carpool.redis_edge.connect import deployment_hint

    try:  # kombu's wrapping, as a publish raises it
        try:
            raise MasterNotFoundError("No master found for 'wrongname'")
        except redis.ConnectionError as exc:
            raise OperationalError(str(exc)) from exc
    except OperationalError as wrapped:
        hint = deployment_hint(wrapped, "CARPOOL_BROKER_URL")
    assert (
        hint is not None and "No master found for 'wrongname'" in hint and "CARPOOL_SENTINEL_MASTER" in hint
    )
    refused = redis.AuthenticationError("invalid username-password pair or user is disabled.")
    assert "CARPOOL_BROKER_URL" in (deployment_hint(refused, "CARPOOL_BROKER_URL") or "")
    assert deployment_hint(redis.ConnectionError("Connection refused"), "CARPOOL_BROKER_URL") is None

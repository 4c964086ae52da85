"""Every Redis client carpool builds for itself: a URL (and the settings) in, a client out.

``redis://`` and ``rediss://`` URLs give a plain client, and so does a Unix socket URL
(``redis+socket:///run/redis.sock?virtual_host=0``, the form kombu and Celery read; redis-py's
``unix:///run/redis.sock?db=0`` is taken too). A list of Sentinel addresses in
kombu's form (``sentinel://h1:26379;sentinel://h2:26379;sentinel://h3:26379/0``) gives a client of
the master the Sentinels know as ``CARPOOL_SENTINEL_MASTER``: it asks them where the master is when
it connects, so after a failover its next connection goes to the promoted replica by itself.
Keyword options pass through to the client (and the connections to the master).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast
from urllib.parse import parse_qs, quote, unquote, urlsplit

import redis
from kombu.exceptions import OperationalError

if TYPE_CHECKING:
    import redis.asyncio

SENTINEL_SCHEME = "sentinel"
SENTINEL_PORT = 26379  # Sentinel's own default port
_SEPARATOR = ";"  # between the addresses of one Sentinel URL, as kombu and Celery split them
SOCKET_SCHEME = "redis+socket"  # how kombu's broker and Celery's backend name a Unix socket
# Celery hands its backend the URL without "redis+"; redis-py's own spelling is unix://.
_SOCKET_SCHEMES = (SOCKET_SCHEME, "socket", "unix")
# Options of TCP connections only: redis-py's UnixDomainSocketConnection refuses them.
_TCP_ONLY = ("socket_keepalive", "socket_keepalive_options")
#: What a call raises while Redis cannot be reached (restarting, a dropped connection), whether it went
#: through redis-py or through kombu, which wraps redis-py's connection errors once its own retries end.
UNREACHABLE = (redis.ConnectionError, redis.TimeoutError, OperationalError)


class SentinelSettings(Protocol):
    """What a Sentinel client needs from :class:`carpool.config.Settings`."""

    @property
    def sentinel_master(self) -> str: ...

    @property
    def sentinel_password(self) -> str: ...


@dataclass(frozen=True, slots=True)
class SentinelUrl:
    """A parsed Sentinel URL: where the Sentinels listen, and what to use on the master they name."""

    sentinels: tuple[tuple[str, int], ...]
    db: int
    username: str | None
    password: str | None

    def server(self) -> tuple[object, ...]:
        """What names the Redis server, without the database: equal for two URLs of one master."""
        return (frozenset(self.sentinels), self.username, self.password)

    def url(self) -> str:
        """The URL again, with the database and credentials on every address.

        kombu and Celery read both from the first address only, so ``.../0`` written on the last one
        alone (the usual way to write it) would silently mean database 0 to them.
        """
        creds = _credentials(self.username, self.password)
        return _SEPARATOR.join(
            f"{SENTINEL_SCHEME}://{creds}{_host(host)}:{port}/{self.db}" for host, port in self.sentinels
        )


@dataclass(frozen=True, slots=True)
class SocketUrl:
    """A parsed Unix socket URL: the socket's path, the database and the credentials."""

    path: str
    db: int
    username: str | None
    password: str | None

    def server(self) -> tuple[object, ...]:
        return ("socket", self.path, self.username, self.password)

    def url(self) -> str:
        """The URL as kombu and Celery read it: ``redis+socket://[user:password@]/path?virtual_host=N``.

        kombu takes a socket URL's path for the database unless ``virtual_host`` says otherwise, so
        it is always written.
        """
        creds = _credentials(self.username, self.password)
        return f"{SOCKET_SCHEME}://{creds}{quote(self.path)}?virtual_host={self.db}"

    def client_kwargs(self) -> dict[str, Any]:
        """What ``redis.Redis`` takes for this socket."""
        return {
            "unix_socket_path": self.path,
            "db": self.db,
            "username": self.username,
            "password": self.password,
        }


def is_socket(url: str) -> bool:
    """Whether ``url`` names a Unix socket (``redis+socket://``, ``socket://`` or ``unix://``)."""
    return url.partition("://")[0] in _SOCKET_SCHEMES and "://" in url


def parse_socket(url: str) -> SocketUrl:
    """Parse a Unix socket URL in kombu's and Celery's form or redis-py's.

    The database is ``virtual_host=N`` (kombu, Celery) or ``db=N`` (redis-py), 0 when neither is
    given; a password may be in the credentials or a ``password=`` parameter. Raises ValueError for
    a URL naming a host, a relative path, other parameters, or two databases.
    """
    split = urlsplit(url)
    example = f"{SOCKET_SCHEME}:///run/redis/redis.sock?virtual_host=0"
    if split.hostname:
        raise ValueError(
            f"a Unix socket URL names a path, not a host ({split.hostname!r}): for example {example}"
        )
    path = unquote(split.path)
    if not path.startswith("/") or path == "/":
        raise ValueError(f"a Unix socket URL needs the socket's absolute path: for example {example}")
    query = parse_qs(split.query, keep_blank_values=True)
    unknown = sorted(set(query) - {"virtual_host", "db", "password"})
    if unknown:
        raise ValueError(
            f"a Unix socket URL takes virtual_host (or db) and password parameters, not {unknown}"
        )
    values = [v for key in ("virtual_host", "db") for v in query.get(key, ())]
    if len(set(values)) > 1:
        raise ValueError(f"names more than one database ({sorted(set(values))}); give one")
    if values and not values[0].isdigit():
        raise ValueError(f"the database must be a number, not {values[0]!r}")
    password = _unquoted(split.password)
    if password is None and query.get("password"):
        password = query["password"][0]
    return SocketUrl(path, int(values[0]) if values else 0, _unquoted(split.username) or None, password)


def is_sentinel(url: str) -> bool:
    """Whether ``url`` is a list of Sentinel addresses rather than one Redis server."""
    return url.startswith(f"{SENTINEL_SCHEME}://")


def parse_sentinel(url: str) -> SentinelUrl:
    """Parse ``sentinel://[user:password@]host[:port][/db]`` addresses joined by ``;``.

    The database and credentials may be written on any address (kombu's own examples put the
    database on the last); raises ValueError when two addresses disagree, or an address is not a
    ``sentinel://`` one.
    """
    sentinels: list[tuple[str, int]] = []
    dbs: set[int] = set()
    creds: set[tuple[str | None, str | None]] = set()
    for part in url.split(_SEPARATOR):
        part = part.strip()
        if not part:
            continue
        split = urlsplit(part)
        if split.scheme != SENTINEL_SCHEME or not split.hostname:
            raise ValueError(f"{_redacted(part)!r} is not a sentinel://host:port address")
        try:
            port = split.port or SENTINEL_PORT
        except ValueError:
            raise ValueError(f"{_redacted(part)!r} has an invalid port") from None
        sentinels.append((split.hostname, port))
        path = split.path.strip("/")
        if path:
            if not path.isdigit():
                raise ValueError(f"{_redacted(part)!r}: the path must be a database number")
            dbs.add(int(path))
        if split.username is not None or split.password is not None:
            creds.add((_unquoted(split.username) or None, _unquoted(split.password)))
    if not sentinels:
        raise ValueError("names no Sentinel address")
    if len(dbs) > 1:
        raise ValueError(f"its addresses name different databases ({sorted(dbs)}); give one")
    if len(creds) > 1:
        raise ValueError("its addresses carry different credentials; give the master's once")
    username, password = next(iter(creds), (None, None))
    return SentinelUrl(tuple(sentinels), next(iter(dbs), 0), username, password)


def server_and_db(url: str) -> tuple[object, int]:
    """(what names the server, the database number) of a carpool Redis URL of any scheme."""
    if is_sentinel(url) or is_socket(url):
        parsed = parse_sentinel(url) if is_sentinel(url) else parse_socket(url)
        return parsed.server(), parsed.db
    from redis.connection import parse_url

    params = parse_url(url)  # type: ignore[no-untyped-call]  # redis-py leaves it untyped
    db = int(params.pop("db", 0) or 0)
    return tuple(sorted((k, repr(v)) for k, v in params.items())), db


def sentinel_kwargs(settings: SentinelSettings, **options: Any) -> dict[str, Any]:
    """The options of the connections to the Sentinels themselves: the socket options among
    ``options`` and ``CARPOOL_SENTINEL_PASSWORD`` (the Sentinels' own, not the master's)."""
    kwargs = {k: v for k, v in options.items() if k.startswith("socket_")}
    if settings.sentinel_password:
        kwargs["password"] = settings.sentinel_password
    return kwargs


def transport_options(settings: SentinelSettings) -> dict[str, Any]:
    """What kombu's Sentinel transport and Celery's Sentinel backend read from their transport
    options (``broker_transport_options`` / ``result_backend_transport_options``)."""
    options: dict[str, Any] = {"master_name": settings.sentinel_master}
    kwargs = sentinel_kwargs(settings)
    if kwargs:
        options["sentinel_kwargs"] = kwargs
    return options


def client_for(url: str, settings: SentinelSettings | None = None, **options: Any) -> redis.Redis:
    """A ``redis.Redis`` for ``url``: a plain client, or one that follows the Sentinels' master."""
    if is_socket(url):
        return redis.Redis(**parse_socket(url).client_kwargs(), **_without_tcp(options))
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **options)
    from redis.sentinel import Sentinel

    parsed, master = _sentinel_target(url, settings)
    assert settings is not None  # _sentinel_target refused None
    # Called as Any: some redis-py releases annotate Sentinel and others do not.
    sentinel: Any = cast("Any", Sentinel)(
        list(parsed.sentinels), sentinel_kwargs=sentinel_kwargs(settings, **options), **options
    )
    client = sentinel.master_for(master, db=parsed.db, username=parsed.username, password=parsed.password)
    return cast("redis.Redis", client)


def async_client_for(
    url: str, settings: SentinelSettings | None = None, **options: Any
) -> redis.asyncio.Redis:
    """The ``redis.asyncio`` twin of :func:`client_for`."""
    import redis.asyncio as aioredis

    if is_socket(url):
        return aioredis.Redis(**parse_socket(url).client_kwargs(), **_without_tcp(options))
    if not is_sentinel(url):
        return aioredis.Redis.from_url(url, **options)
    from redis.asyncio.sentinel import Sentinel

    parsed, master = _sentinel_target(url, settings)
    assert settings is not None
    sentinel: Any = cast("Any", Sentinel)(  # as in client_for
        list(parsed.sentinels), sentinel_kwargs=sentinel_kwargs(settings, **options), **options
    )
    client = sentinel.master_for(master, db=parsed.db, username=parsed.username, password=parsed.password)
    return cast("redis.asyncio.Redis", client)


def _sentinel_target(url: str, settings: SentinelSettings | None) -> tuple[SentinelUrl, str]:
    from carpool.errors import ConfigError

    master = settings.sentinel_master if settings is not None else ""
    if not master:
        raise ConfigError(
            "a sentinel:// URL needs the name of the master the Sentinels monitor: "
            "set CARPOOL_SENTINEL_MASTER"
        )
    try:
        return parse_sentinel(url), master
    except ValueError as exc:
        raise ConfigError(f"Sentinel URL {_redacted(url)!r}: {exc}") from None


def missing_database(error: BaseException, *settings: str) -> Exception | None:
    """The deployment error a SELECT of a database the server lacks is (a URL's /DB past the server's
    ``databases``, 16 by default): retrying cannot mend it. None for any other error."""
    from carpool.errors import ConfigError

    found: BaseException | None = error
    while found is not None and not (
        isinstance(found, redis.ResponseError | OperationalError) and "DB index is out of range" in str(found)
    ):
        found = found.__cause__ or found.__context__  # kombu wraps redis-py's errors
    if found is None:
        return None
    error = found
    return ConfigError(
        f"Redis has no such database ({error}): {' and '.join(settings)} must name a database number"
        " below the server's `databases` setting (16 by default: 0 to 15)"
    )


def refused_credentials(error: BaseException, *settings: str) -> str | None:
    """What to change when Redis refused a connection's user and password (or wanted a password none
    was given): a sentence naming ``settings``, the variables that hold the URLs; None for any
    other error. Sentinel's own password is another setting, named when a URL is a Sentinel one."""
    refusal: BaseException | None = error
    while refusal is not None and not isinstance(refusal, redis.AuthenticationError):
        refusal = refusal.__cause__ or refusal.__context__  # kombu wraps redis-py's errors
    if refusal is None:
        return None
    return (
        f"Redis refused the credentials ({refusal}): put the user and password Redis expects in "
        f"{' and '.join(settings)} (redis://USER:PASSWORD@HOST:PORT/DB; a password alone: "
        "redis://:PASSWORD@HOST:PORT/DB; a Sentinel's own password goes in CARPOOL_SENTINEL_PASSWORD)"
    )


def deployment_hint(error: BaseException, *settings: str) -> str | None:
    """What to change when a connection failed for a setting rather than an outage: credentials
    Redis refused (:func:`refused_credentials`), or Sentinels that know no master of the name
    ``CARPOOL_SENTINEL_MASTER`` gives; None for any other error."""
    hint = refused_credentials(error, *settings)
    if hint is not None:
        return hint
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, redis.sentinel.MasterNotFoundError):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return None
    return (
        f"the Sentinels answered {cause}: CARPOOL_SENTINEL_MASTER must be the name they monitor"
        " (SENTINEL MASTERS on a Sentinel lists them)"
    )


def _credentials(username: str | None, password: str | None) -> str:
    """``user:password@`` as a URL writes them (quoted), or nothing."""
    if password is not None:
        return f"{quote(username or '', safe='')}:{quote(password, safe='')}@"
    return f"{quote(username, safe='')}@" if username is not None else ""


def _without_tcp(options: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k not in _TCP_ONLY}


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _unquoted(value: str | None) -> str | None:
    return unquote(value) if value is not None else None


def _redacted(url: str) -> str:
    from carpool.config import redact_url

    return redact_url(url)


#: The oldest Redis carpool's scripts run on: RPOP with a count, ZMSCORE and BLMOVE came in 6.2.
MIN_REDIS = (6, 2)


def check_server(broker: Any, results: Any, role: str) -> None:
    """At a coordinator's or worker's start: raise :class:`~carpool.errors.ConfigError` for a Redis
    carpool cannot run on (older than 6.2, or a results database the server lacks), and log an
    error for one that may lose requests or results (a ``maxmemory-policy`` that evicts keys, on
    the broker's server and on the results' when it is another). A server not reachable yet, or that
    refuses INFO (renamed away, or not in an ACL user's grants), is passed over: the process
    retries as it runs, and the checks need INFO."""
    from carpool.errors import ConfigError

    server, memory = _info(broker)
    if server:
        text = str(server.get("redis_version", ""))
        version = tuple(int(part) for part in text.split(".")[:2] if part.isdigit())
        if len(version) == 2 and version < MIN_REDIS:
            raise ConfigError(
                f"Redis {text} at CARPOOL_BROKER_URL is too old: carpool needs Redis 6.2 or newer"
                " (its scripts use RPOP with a count, ZMSCORE and BLMOVE)"
            )
    _check_eviction(memory, role, "CARPOOL_BROKER_URL", "queued and in-flight requests")
    if results is None:
        return
    if not database_answers(results, "CARPOOL_RESULT_BACKEND"):
        return
    results_server, results_memory = _info(results)
    if results_server and results_server.get("run_id") != (server or {}).get("run_id"):
        _check_eviction(results_memory, role, "CARPOOL_RESULT_BACKEND", "stored results")


def database_answers(client: Any, setting: str) -> bool:
    """PING ``client``: whether its server answered (a refusal is an answer); raises
    :class:`~carpool.errors.ConfigError` naming ``setting`` where the server lacks the URL's
    database (no retry mends that). False where the server cannot be reached (a process retries as
    it runs)."""
    try:
        client.ping()
    except (redis.ConnectionError, redis.TimeoutError):
        return False
    except redis.ResponseError as exc:
        missing = missing_database(exc, setting)
        if missing is not None:
            raise missing from None
    except redis.RedisError:  # no Redis answering there (a protocol error): the process says so as it runs
        return False
    return True


def _info(client: Any) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """INFO server and INFO memory of ``client``'s server; (None, None) where it cannot be read."""
    try:
        return client.info("server"), client.info("memory")
    except (redis.ConnectionError, redis.TimeoutError, redis.ResponseError):
        return None, None


def _check_eviction(memory: dict[str, Any] | None, role: str, setting: str, what: str) -> None:
    import logging

    policy = str((memory or {}).get("maxmemory_policy", "noeviction"))
    if policy == "noeviction":
        return
    limited = int((memory or {}).get("maxmemory", 0) or 0) > 0
    logging.getLogger("carpool").log(
        logging.ERROR if limited else logging.WARNING,
        "%s: the Redis at %s has maxmemory-policy %s: %s it evicts keys, and carpool's %s are keys,"
        " lost without an error to anyone; set maxmemory-policy noeviction (writes are then refused"
        " and retried)",
        role,
        setting,
        policy,
        "when it reaches maxmemory" if limited else "once a maxmemory is set",
        what,
    )


class EvictionWatch:
    """Tells, at ERROR, of keys a server evicted since the last look: under a ``maxmemory-policy``
    other than ``noeviction`` the requests, in-flight state and results carpool keeps are keys, and
    those evicted are never answered, with nothing else said (the worker sees only requests gone
    from flight, as if a recovery had taken them). The first look sets the count to compare with;
    a count that went back (a restarted server) too."""

    def __init__(self, role: str, setting: str) -> None:
        self.role, self.setting = role, setting
        self.seen: int | None = None

    def check(self, client: Any) -> int:
        """Read the server's eviction count; log and return how many keys it evicted since the last
        look (0 where none, or where INFO cannot be read: the next look tries again)."""
        try:
            evicted = int(client.info("stats").get("evicted_keys", 0) or 0)
            memory = client.info("memory")
        except (redis.RedisError, ValueError, TypeError):
            return 0
        before, self.seen = self.seen, evicted
        if before is None or evicted <= before:
            return 0
        import logging

        logging.getLogger("carpool").error(
            "%s: the Redis at %s evicted %d keys since the last look (maxmemory-policy %s, maxmemory"
            " %s bytes): carpool's queued and in-flight requests and stored results are keys, and"
            " those evicted are never answered; set maxmemory-policy noeviction (writes are then"
            " refused and retried) and give Redis the memory it needs",
            self.role,
            self.setting,
            evicted - before,
            memory.get("maxmemory_policy"),
            memory.get("maxmemory"),
        )
        return evicted - before

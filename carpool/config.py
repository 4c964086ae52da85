"""One settings object, read from ``CARPOOL_*`` environment variables at each entry point.

Producers, the coordinator and workers each build :class:`Settings` once (``load_settings()``) and
pass it down; nothing else reads the environment.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from carpool.errors import ConfigError
from carpool.names import DEFAULT_BIN_EDGES, MAX_BATCH_LIMIT, PolicyName

log = logging.getLogger(__name__)

DeviceName = Literal["auto", "cpu", "cuda"]


def batch_queue_for(request_queue: str) -> str:
    """The batch queue a deployment with ``request_queue`` uses unless CARPOOL_BATCH_QUEUE says."""
    return f"{request_queue.removesuffix('.requests')}.batches"


# The query options of a rediss:// URL that Celery's backend and kombu's transport both read.
_TLS_OPTIONS = frozenset({"ssl_cert_reqs", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile"})
#: The ``ssl_cert_reqs`` every client reads: kombu, Celery and redis-py's own (which carpool's
#: clients are) all take these; Celery's ``CERT_*`` spellings fail redis-py's.
_CERT_REQS = ("required", "optional", "none")


class Settings(BaseSettings):
    """Every knob carpool has. Environment variable = ``CARPOOL_`` + field name in upper case."""

    model_config = SettingsConfigDict(env_prefix="CARPOOL_", extra="ignore", frozen=True)

    # --- connections -------------------------------------------------------------------------
    broker_url: str = Field(
        "redis://localhost:6379/0",
        description=(
            "Celery broker (Redis) URL; a Unix socket as redis+socket:///run/redis.sock?virtual_host=0; "
            "or Sentinel addresses: sentinel://h1:26379;sentinel://h2:26379/0."
        ),
    )
    result_backend: str = Field(
        "redis://localhost:6379/1",
        description="Result backend (Redis) URL, a Unix socket or Sentinel addresses, as for the broker.",
    )
    sentinel_master: str = Field(
        "", description="Name of the master the Sentinels monitor; required with sentinel:// URLs."
    )
    sentinel_password: str = Field(
        "",
        description=(
            "The Sentinels' own password (their requirepass), if any; the master's goes in the URLs."
        ),
        repr=False,
    )
    wait_replicas: int = Field(
        0,
        ge=0,
        le=64,
        description=(
            "> 0: .delay() returns only once this many replicas have the request (Redis WAIT); workers "
            "and coordinators wait likewise for results and in-flight state. 0: asynchronous."
        ),
    )
    wait_timeout_s: float = Field(
        1.0,
        gt=0,
        le=60,
        description=(
            "Longest a WAIT for CARPOOL_WAIT_REPLICAS waits; fewer acks by then raise NotReplicated. "
            "At least 1 s under CARPOOL_REDIS_SOCKET_TIMEOUT_S."
        ),
    )
    redis_socket_timeout_s: float = Field(
        10.0,
        ge=2,
        le=300,
        description=(
            "Longest any Redis client (carpool's, Celery's, kombu's) waits for a reply or a connection "
            "before dropping it as dead (a stalled or half-open connection); above every blocking wait."
        ),
    )
    redis_health_check_s: float = Field(
        10.0,
        gt=0,
        le=300,
        description=(
            "Redis connections idle this long are PINGed before use; a pub/sub or waiting connection "
            "whose PINGs or replies stay unanswered that long is reconnected."
        ),
    )

    # --- queues ------------------------------------------------------------------------------
    request_queue: str = Field("carpool.requests", min_length=1, description="List `.delay()` writes to.")
    batch_queue: str = Field(
        "carpool.batches",
        min_length=1,
        description="Queue of micro-batch tasks. Unset, it follows CARPOOL_REQUEST_QUEUE: NAME.requests"
        " gives NAME.batches, any other QUEUE gives QUEUE.batches (two deployments sharing a Redis"
        " database with their own request queues must not share a batch queue).",
    )
    result_inbox: bool = Field(
        True,
        description=(
            "submit_many's results come back to each producer process on one pub/sub channel, which "
            "gather subscribes while it waits (false: one subscription per request, as `.delay()`)."
        ),
    )

    # --- model -------------------------------------------------------------------------------
    model: str = Field(
        "minilm",
        min_length=1,
        description="minilm, toy, null, sim-v100/sim-h100 (a simulated accelerator) or package.module:Class.",
    )
    models: Annotated[tuple[str, ...], NoDecode] = Field(
        (), description="Models served beside `model` (always served, the default), comma separated."
    )
    imports: Annotated[tuple[str, ...], NoDecode] = Field(
        (), description="Modules defining @batched tasks, comma separated (like Celery's `imports`)."
    )
    serve_tasks: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description=(
            "Tasks this worker runs, comma separated (`carpool.infer` for the models); empty = every task "
            "(a dedicated worker names its own)."
        ),
    )
    device: DeviceName = Field("auto", description="auto picks CUDA when available, else CPU.")
    torch_threads: int = Field(
        0, ge=0, le=1024, description="CPU threads for torch; 0 leaves torch's default."
    )
    autocast_bf16: bool = Field(
        False,
        description=(
            "Run CUDA batches under bf16 autocast (`carpool.infer`'s models and the adapters; a "
            "`@batched` function of your own runs as written)."
        ),
    )
    overlap_finish: bool = Field(
        True,
        description=(
            "Store a batch's results while the next batch runs, when one is queued (false: one after the "
            "other)."
        ),
    )
    overlap_device: bool = Field(
        True,
        description=(
            "Run batches on a device thread while the Celery thread claims the next, when one is queued "
            "(false: claim, run and store one batch at a time on the Celery thread). On an asynchronous "
            "device (MiniLM on CUDA, the simulated devices) the device thread launches the next batch "
            "before collecting the one running, so the device has work queued behind it."
        ),
    )
    claim_takes_next: bool = Field(
        True,
        description=(
            "A batch's claim also takes the next batch message off the batch queue, which the worker then "
            "runs without returning to Celery's consumer for it (false: every batch message is fetched "
            "by Celery's consumer, one BRPOP each). Only where the results live on the broker's Redis "
            "server (the claim is then one script) and with `CARPOOL_OVERLAP_DEVICE` on; a Celery task "
            "runs taken batches for at most about 0.25 s before it returns to Celery's event loop, and "
            "none are taken once the worker is shutting down. Each taken batch still shows in Flower as "
            "its own `carpool.run_batch` task."
        ),
    )

    # --- batching policy ---------------------------------------------------------------------
    policy: PolicyName = Field("binned", description="Queueing strategy of the coordinator.")
    max_batch: int = Field(32, ge=1, le=MAX_BATCH_LIMIT, description="Most requests in one batch.")
    max_tokens: int = Field(8192, ge=8, description="Most padded tokens (count x longest) in one batch.")
    max_wait_s: float = Field(0.05, ge=0, le=60, description="Longest a partial batch waits for company.")
    wait_factor: float = Field(
        0.3, ge=0, le=10, description="Wait about this x the predicted run time of the batch being formed."
    )
    bin_edges: Annotated[tuple[int, ...], NoDecode] = Field(
        DEFAULT_BIN_EDGES, description="Upper token-length edges of the bins, comma separated."
    )
    auto_bins: int = Field(
        0,
        ge=0,
        le=32,
        description="> 0: fit that many bins to recent lengths (CARPOOL_BIN_EDGES=auto sets 6).",
    )
    tight_backlog: bool = Field(
        True,
        description=(
            "binned: a bin holding more than one batch cuts its oldest request plus the nearest lengths, "
            "padding about as little as a length-sorted pass (false: its oldest requests, in arrival order)."
        ),
    )
    default_deadline_s: float = Field(60.0, gt=0, description="Deadline of a request without `expires`.")
    prefetch_batches: int = Field(
        2,
        ge=0,
        le=64,
        description=(
            "Batches queued per worker beyond the one it runs, to hide hand-off (2 keeps a worker's device "
            "stage fed: one batch waits beside the one running while the previous one's results are stored)."
        ),
    )
    prefetch_s: float = Field(
        0.03,
        ge=0,
        le=10,
        description=(
            "Full batches are also queued beyond CARPOOL_PREFETCH_BATCHES while the predicted work queued "
            "per worker is under this many seconds (a fast device runs a batch in a few ms: a count of "
            "batches alone leaves it waiting on the hand-off), once a batch of the task or model has run "
            "(its run time is then measured, not guessed); 0 = the count only."
        ),
    )

    # --- reliability -------------------------------------------------------------------------
    recovery_timeout_s: float = Field(
        30.0,
        ge=2,
        le=60,
        description=(
            "Requests held by a dead process return to the queue after this; at least 2 s, since a"
            " worker renews the leases of what it runs every second (at most 60)."
        ),
    )
    truncate: bool = Field(
        True,
        description="Cut texts past the model's window as sentence-transformers does; false rejects them.",
    )
    max_input_bytes: int = Field(65536, ge=1, description="Largest accepted text, UTF-8 bytes.")
    max_pending: int = Field(
        100_000,
        ge=1,
        description=(
            "Past this many requests waiting in a coordinator (in its bins, being prepared, or held for"
            " their countdown/eta), it refuses new ones with QueueFull; per coordinator."
        ),
    )
    result_expires_s: int = Field(
        86400, ge=1, le=10 * 365 * 86400, description="How long results stay in the backend (up to 10 years)."
    )
    result_serializer: Literal["msgpack", "json"] = Field(
        "msgpack",
        description=(
            "How results are stored (Celery's `result_serializer`). `msgpack`: an embedding's floats are "
            "the model's float32 values exactly (`row.tolist()`), packed in about a tenth of the CPU time "
            "of JSON's decimals and in two fifths of the bytes; `json`: each float as its shortest "
            "decimal, as before. Every carpool process reads both; a plain Celery client reads them with "
            'this app\'s configuration (docs/OPERATIONS.md, "Results as msgpack").'
        ),
    )

    # --- coordinator internals ---------------------------------------------------------------
    take_max: int = Field(
        1000, ge=1, le=100_000, description="Most requests taken from Redis per round trip."
    )
    tokenizer_threads: int = Field(
        0,
        ge=0,
        le=64,
        description=(
            "Threads that tokenize a large take on the coordinator, one chunk of 64 requests each, while "
            "its loop goes on dispatching; 0 = half the cores it may run on, at least 1, at most 4. A "
            "model's encode must be thread-safe with more than 1 (HF tokenizers are)."
        ),
    )
    idle_poll_s: float = Field(
        0.02,
        gt=0,
        le=1,
        description=(
            "How long an idle coordinator waits in Redis before looking at the priority lists and batch "
            "reports again (an idle Redis may stretch it to 0.1 s); a request at the default priority "
            "wakes it at once."
        ),
    )
    events: bool | Literal["auto"] = Field(
        "auto",
        description=(
            "Task events (producers' task-sent, the coordinator's and workers' per request and per "
            "batch), so Flower lists every request and batch: `auto` while some client receives them "
            "(Flower, `celery events`; asked every 0.1 s), `true` always, `false` never."
        ),
    )
    metrics_port: int = Field(
        9808, ge=0, le=65535, description="Prometheus port of the coordinator; 0 = off."
    )

    @field_validator("bin_edges", mode="before")
    @classmethod
    def _parse_edges(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            if not text:
                return ()
            try:
                return tuple(int(part) for part in text.split(","))
            except ValueError:
                raise ValueError("must be comma-separated integers, for example 16,32,64,128") from None
        return value

    @model_validator(mode="before")
    @classmethod
    def _batch_queue_follows_request_queue(cls, data: object) -> object:
        # A deployment given its own request queue and the default batch queue ran another
        # deployment's batches, whose requests its workers skipped as belonging elsewhere.
        if isinstance(data, dict) and data.get("request_queue") and not data.get("batch_queue"):
            data = {**data, "batch_queue": batch_queue_for(str(data["request_queue"]))}
        return data

    @model_validator(mode="before")
    @classmethod
    def _auto_edges(cls, data: object) -> object:
        if isinstance(data, dict) and str(data.get("bin_edges", "")).strip().lower() == "auto":
            data = {**data, "bin_edges": DEFAULT_BIN_EDGES}
            if not int(data.get("auto_bins") or 0):
                data["auto_bins"] = 6
        return data

    @field_validator("models", "imports", "serve_tasks", mode="before")
    @classmethod
    def _parse_models(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @property
    def served_models(self) -> tuple[str, ...]:
        """The default model first, then any others in ``models``."""
        return (self.model, *(m for m in self.models if m != self.model))

    def shared_server_dbs(self) -> tuple[int, int] | None:
        """(broker db, results db) when the broker and the result backend are one Redis server.

        Then a worker claims a batch in one script and finishes it (results, acks, report, events) in
        another, switching databases inside the script; otherwise it needs a few more round trips.
        Two Sentinel URLs name one server when they list the same Sentinels (which name one master,
        ``sentinel_master``) with the same credentials.
        """
        from carpool.redis_edge.connect import server_and_db

        broker, broker_db = server_and_db(self.broker_url)
        results, results_db = server_and_db(self.result_backend)
        return (broker_db, results_db) if broker == results else None

    @field_validator("bin_edges")
    @classmethod
    def _check_edges(cls, edges: tuple[int, ...]) -> tuple[int, ...]:
        if any(e < 1 for e in edges) or list(edges) != sorted(set(edges)):
            raise ValueError("must be strictly increasing positive integers, for example 16,32,64,128")
        return edges

    @field_validator("broker_url", "result_backend")
    @classmethod
    def _check_url(cls, url: str, info: ValidationInfo) -> str:
        from carpool.redis_edge.connect import is_sentinel, is_socket, parse_sentinel, parse_socket

        if is_sentinel(url):
            # Rewritten with the database and credentials on every address: kombu and Celery read
            # them from the first address only.
            return parse_sentinel(url).url()
        if is_socket(url):
            # Rewritten in kombu's and Celery's spelling, with the database always named: kombu
            # would read a socket URL's path as its database otherwise.
            return parse_socket(url).url()
        if not url.startswith(("redis://", "rediss://")):
            raise ValueError(
                "must be a redis://, rediss://, redis+socket:// (a Unix socket) or sentinel:// URL"
            )
        from urllib.parse import parse_qs, urlsplit

        parts = urlsplit(url)
        query = parse_qs(parts.query, keep_blank_values=True)
        if "db" in query:
            # redis-py reads it, but kombu hands it on to the connection, which refuses it at publish.
            raise ValueError("name the database in the URL's path (redis://host:6379/1), not as ?db=")
        # kombu hands a query's options to redis-py's connection as they are (strings, or names it
        # refuses), after the settings and the first connections have passed: each is refused here.
        tls = parts.scheme == "rediss"
        for option in query:
            if option in _TLS_OPTIONS and not tls:
                raise ValueError(
                    f"?{option}= applies to a TLS connection, and this URL is redis://: use rediss://"
                    " for TLS, or drop the option"
                )
            if option not in _TLS_OPTIONS:
                allowed = f" (only {', '.join(sorted(_TLS_OPTIONS))} on a rediss:// URL)"
                raise ValueError(
                    f"?{option}= is not an option carpool passes to Redis{allowed}: carpool sets its"
                    " connections' own options (timeouts: CARPOOL_REDIS_SOCKET_TIMEOUT_S, health checks:"
                    " CARPOOL_REDIS_HEALTH_CHECK_S); drop it from the URL"
                )
        reqs = query.get("ssl_cert_reqs", [None])[-1]
        if reqs is not None and reqs not in _CERT_REQS:
            raise ValueError(
                f"?ssl_cert_reqs={reqs} is not one of {', '.join(_CERT_REQS)} (carpool's own Redis"
                " clients, redis-py's, read only those; for CERT_REQUIRED write required)"
            )
        if tls and reqs is None and info.field_name == "result_backend":
            # Celery's Redis result backend raises this at the app's first use, in every process.
            raise ValueError(
                "a rediss:// result backend needs ?ssl_cert_reqs=required (or optional, or none: no"
                " certificate check), as Celery's result backend requires"
            )
        if not parts.hostname:
            # redis-py reads no host as localhost: what a template with an unset variable writes.
            raise ValueError(
                "names no host (an unset variable in a template?): name one, redis://localhost:6379/0"
                " for this machine"
            )
        try:
            parts.port  # noqa: B018  # parsing it is the check
        except ValueError as exc:  # redis-py would raise this at the first connection
            raise ValueError(f"its port is not a port number: {exc}") from None
        db = parts.path.strip("/")
        if db and not db.isdigit():
            raise ValueError(f"its path names the database by its number (redis://host:6379/1), not {db!r}")
        return url

    @model_validator(mode="after")
    def _check_queues(self) -> Settings:
        from carpool.models import BUILTIN, is_valid_name

        for name in self.served_models:
            if not is_valid_name(name):
                raise ValueError(
                    f"CARPOOL_MODEL/CARPOOL_MODELS: {name!r} is not one of {', '.join(BUILTIN)} "
                    "or package.module:ClassName"
                )
        from carpool.redis_edge.connect import is_sentinel

        if not self.sentinel_master and (is_sentinel(self.broker_url) or is_sentinel(self.result_backend)):
            raise ValueError(
                "sentinel:// URLs need CARPOOL_SENTINEL_MASTER, the name of the master the Sentinels monitor"
            )
        if self.request_queue == self.batch_queue:
            raise ValueError("CARPOOL_REQUEST_QUEUE and CARPOOL_BATCH_QUEUE must differ")
        if self.wait_replicas and self.wait_timeout_s > self.redis_socket_timeout_s - 1:
            # A WAIT that outlasts the socket timeout reads as a dead connection, and is sent again.
            raise ValueError(
                f"CARPOOL_WAIT_TIMEOUT_S ({self.wait_timeout_s:g}) must stay at least 1 s under "
                f"CARPOOL_REDIS_SOCKET_TIMEOUT_S ({self.redis_socket_timeout_s:g}): lower the first or "
                "raise the second"
            )
        return self


# CARPOOL_* variables read outside the settings (the bench's simulated device, its task mode).
_OTHER_VARIABLES = frozenset(
    {
        "CARPOOL_SIM_DEVICE",
        "CARPOOL_SIM_DEVICE_LOG",
        "CARPOOL_REDIS_SERVER",
        "CARPOOL_BENCH_TASK",
        "CARPOOL_BENCH_MODEL_DIR",
    }
)


_WARNED: set[str] = set()


def load_settings(**overrides: object) -> Settings:
    """Build settings from the environment (and explicit overrides), or raise a readable ConfigError."""
    try:
        settings = Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        raise ConfigError(_explain(exc)) from None
    _warn_misspelled(os.environ)
    return settings


def _warn_misspelled(environ: Mapping[str, str]) -> None:
    """Warn of a CARPOOL_* variable that is no setting but nearly names one (CARPOOL_MAX_BACH): the
    setting keeps its default, which nothing else would say. Others (a deployment's own) pass."""
    known = {f"CARPOOL_{name.upper()}" for name in Settings.model_fields}
    for name in environ:
        if not name.startswith("CARPOOL_") or name in known or name in _OTHER_VARIABLES:
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
        if close and name not in _WARNED:
            _WARNED.add(name)  # once per process, however often settings are loaded
            log.warning("%s is not a carpool setting and is ignored: did you mean %s?", name, close[0])


def _explain(exc: ValidationError) -> str:
    """One line per setting: pydantic's messages (one per member of a union, as for ``true``,
    ``false`` or ``auto``, joined), and the value given, its passwords hidden."""
    problems: dict[str, tuple[list[str], object]] = {}
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else ""  # the rest names pydantic's union branches
        messages, got = problems.setdefault(field, ([], err.get("input")))
        messages.append(err["msg"])
    lines = ["invalid carpool settings:"]
    for field, (messages, got) in problems.items():
        name = f"CARPOOL_{field.upper()}" if field else "settings"
        if isinstance(got, str) and field == "sentinel_password":
            got = "***"
        elif isinstance(got, str):
            got = redact_url(got)
        got_text = "" if isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"  {name}: {'; or '.join(messages)}{got_text}")
    return "\n".join(lines)


_PASSWORD_PARAM = re.compile(r"(^|&)(password=)[^&#]*", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` with every password replaced by ``***``, for logs and terminals.

    Covers ``user:password@`` and ``:password@`` credentials (a lone ``secret@`` is hidden whole, as
    some clients read it as a password), ``redis``, ``rediss`` and ``unix`` URLs, a ``password=``
    query parameter, ``;``-separated multi-host lists such as kombu's sentinel URLs, and a
    ``module:Class+redis://`` backend prefix. The host, port, path and other parameters stay readable.
    """
    parts = url.split(";")
    if len(parts) > 1 and not all("://" in part for part in parts):
        return _redact_one(url)  # a ';' inside a password, not between hosts
    return ";".join(_redact_one(part) for part in parts)


def _redact_one(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    # Credentials end at the last '@' before the query, so an unescaped '@' or '/' in a password
    # is hidden too.
    head, question, query = rest.partition("?")
    creds, at, host = head.rpartition("@")
    if at:
        user, colon, _ = creds.partition(":")
        head = f"{user}:***@{host}" if colon else f"***@{host}"
    query = _PASSWORD_PARAM.sub(r"\1\2***", query)
    return f"{scheme}://{head}{question}{query}"

"""carpool.celery_edge.compat: the installed Celery and kombu are ones it was checked against, and every
private name it relies on is still there with the parameters it calls it with."""

from __future__ import annotations

import importlib
import inspect
import time
import tomllib
from pathlib import Path
from typing import Any

import celery
import kombu
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from carpool.celery_edge import compat


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


@pytest.mark.parametrize(
    ("name", "version", "supported"),
    [
        ("celery", celery.__version__, compat.CELERY_VERSIONS),
        ("kombu", kombu.__version__, compat.KOMBU_VERSIONS),
    ],
)
def test_installed_versions_are_the_ones_compat_was_written_for(
    name: str, version: str, supported: tuple[tuple[int, int], tuple[int, int]]
) -> None:
    lowest, first_unsupported = supported
    assert lowest <= _major_minor(version) < first_unsupported, (
        f"{name} {version} is outside what carpool.celery_edge.compat was checked against "
        f"({lowest} up to, not including, {first_unsupported}): read the new code behind every "
        "function in compat.py, then widen the range"
    )


@pytest.mark.parametrize(
    ("name", "supported"),
    [("celery", compat.CELERY_VERSIONS), ("kombu", compat.KOMBU_VERSIONS)],
)
def test_pyproject_allows_exactly_the_checked_range(
    name: str, supported: tuple[tuple[int, int], tuple[int, int]]
) -> None:
    """pip must not resolve a release compat.py was never read against, nor refuse one it was."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    (requirement,) = [r for r in map(Requirement, dependencies) if r.name == name]
    lowest, first_unsupported = supported
    inside = [Version(f"{lowest[0]}.{lowest[1]}.0")]
    inside.append(Version(f"{first_unsupported[0]}.{first_unsupported[1] - 1}.99"))
    outside = [
        Version(f"{lowest[0]}.{lowest[1] - 1}.99"),
        Version(f"{first_unsupported[0]}.{first_unsupported[1]}.0"),
    ]
    assert all(requirement.specifier.contains(v) for v in inside), (
        f"pyproject's {requirement} refuses a version inside compat.py's {supported}"
    )
    assert not any(requirement.specifier.contains(v) for v in outside), (
        f"pyproject's {requirement} allows a version outside compat.py's {supported}: narrow it, "
        "or read the new release's code behind compat.py and widen both"
    )


def _instance_of(class_path: str) -> Any:
    """An instance of the class, made without touching the network (for instance attributes)."""
    from carpool.celery_edge.app import app

    if class_path == "celery.result:AsyncResult":
        return app.AsyncResult("compat-check")
    if class_path == "celery.backends.redis:ResultConsumer":
        return app.backend.result_consumer
    return None


def _resolve(class_path: str) -> type:
    module, _, name = class_path.partition(":")
    cls: type = getattr(importlib.import_module(module), name)
    return cls


@pytest.mark.parametrize(
    ("class_path", "attribute", "parameters"),
    compat.RELIED_ON,
    ids=[f"{c.partition(':')[2]}.{a}" for c, a, _ in compat.RELIED_ON],
)
def test_every_private_name_relied_on_is_there(
    class_path: str, attribute: str, parameters: tuple[str, ...] | None
) -> None:
    cls = _resolve(class_path)
    if parameters is None:  # a plain attribute, possibly set per instance
        instance = _instance_of(class_path)
        assert hasattr(cls, attribute) or (instance is not None and hasattr(instance, attribute)), (
            f"{class_path} no longer has {attribute}"
        )
        return
    method = inspect.getattr_static(cls, attribute, None)
    assert callable(method), f"{class_path} no longer has the method {attribute}"
    names = tuple(inspect.signature(method).parameters)[1:]  # without self
    assert names == parameters, f"{class_path}.{attribute} now takes {names}, compat expects {parameters}"


def test_carpool_subclasses_override_what_they_mean_to() -> None:
    """The hooks carpool's subclasses define have the names Celery calls."""
    from carpool.celery_edge.app import app
    from carpool.celery_edge.result_consumer import PromptResultConsumer
    from carpool.celery_edge.results import CarpoolRedisBackend

    assert isinstance(app.backend, CarpoolRedisBackend)
    assert isinstance(app.backend.result_consumer, PromptResultConsumer)
    for name in ("drain_events_until", "cancel_for", "_wait_for_pending", "on_state_change"):
        assert name in PromptResultConsumer.__dict__


def test_join_will_block_outside_a_worker() -> None:
    assert compat.join_will_block() is False


def test_revokes_read_from_redis_keep_their_age_in_a_celery_limited_set() -> None:
    """A LimitedSet ages entries on the monotonic clock; a revoke recorded by the wall clock joins
    it as old as it is, so it leaves when a worker that heard it itself would have dropped it."""
    from celery.utils.collections import LimitedSet

    now = time.time()
    heard = LimitedSet(expires=100)
    heard.add("heard-here")
    compat.add_revoked([("old", now - 150.0), ("recent", now - 10.0), ("heard-here", now - 99.0)], heard, now)
    heard.purge()
    assert "old" not in heard and "recent" in heard
    assert "heard-here" in heard, "one heard here keeps its own age"
    heard.purge(now=time.monotonic() + 95)  # "recent" is 105 s old then
    assert "recent" not in heard and "heard-here" in heard


def test_the_guarded_transports_are_kombus_redis_ones_and_only_a_worker_has_them() -> None:
    from kombu.transport import redis as kombu_redis

    from carpool.celery_edge.app import create_app
    from carpool.config import load_settings

    # Only carpool worker's process has them (cmd_worker); an app imported elsewhere has kombu's.
    fresh = create_app(load_settings(broker_url="redis://h:6379/0"))
    assert not isinstance(fresh.connection_for_read().transport, compat.GuardedRedisTransport)
    for guarded, base in (
        (compat.GuardedRedisTransport, kombu_redis.Transport),
        (compat.GuardedSentinelTransport, kombu_redis.SentinelTransport),
    ):
        assert issubclass(guarded.Channel, base.Channel)
        for name in ("_brpop_read", "_create_client"):  # the hooks kombu calls
            assert name in guarded.Channel.__dict__


@pytest.mark.parametrize(
    "url",
    [
        "redis://:pw@h:6379/0",
        "rediss://:pw@h:6380/0",  # kombu turns TLS on for the rediss transport by its name only
        "rediss://:pw@h:6380/0?ssl_cert_reqs=required",
        "redis+socket:///tmp/carpool-test.sock",
        "sentinel://h:26379",
    ],
)
def test_the_workers_guarded_broker_is_kombus_own_under_its_name(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kombu.transport
    from celery import Celery

    theirs = Celery(broker=url).connection_for_read()
    kombus, their_ssl, their_uri = type(theirs.transport), theirs.ssl, theirs.as_uri()  # resolved now
    # The worker's process changes kombu's own tables: here, copies of them, left after the test.
    monkeypatch.setattr(kombu.transport, "TRANSPORT_ALIASES", dict(kombu.transport.TRANSPORT_ALIASES))
    monkeypatch.setattr(kombu.transport, "_transport_cache", dict(kombu.transport._transport_cache))
    compat.guard_broker_transports()
    ours = Celery(broker=url).connection_for_read()
    assert isinstance(ours.transport, compat.GuardedRedisTransport | compat.GuardedSentinelTransport)
    assert type(ours.transport).__mro__[1] is kombus
    assert ours.ssl == their_ssl and bool(ours.ssl) == url.startswith("rediss://")
    assert ours.as_uri() == their_uri  # what Celery's banner and logs show
    # With an app's own broker_use_ssl, what kombu makes of it and of the URL's options, unchanged.
    configured = Celery(broker=url)
    configured.conf.broker_use_ssl = {"ssl_cert_reqs": "required"}
    monkeypatch.undo()
    plain = Celery(broker=url)
    plain.conf.broker_use_ssl = {"ssl_cert_reqs": "required"}
    assert configured.connection_for_read().ssl == plain.connection_for_read().ssl

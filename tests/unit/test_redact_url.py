"""``carpool.config.redact_url``: passwords never reach a log line or a terminal; the rest stays readable."""

from __future__ import annotations

import pytest

from carpool.config import redact_url


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://localhost:6379/0", "redis://localhost:6379/0"),
        ("redis://alice:s3cret@redis:6379/0", "redis://alice:***@redis:6379/0"),
        ("redis://:s3cret@redis:6379/0", "redis://:***@redis:6379/0"),
        ("redis://s3cret@redis:6379/0", "redis://***@redis:6379/0"),
        (
            "rediss://:s3cret@host:6380/1?ssl_cert_reqs=required",
            "rediss://:***@host:6380/1?ssl_cert_reqs=required",
        ),
        # Unescaped '@' and '/' in a password still end at the host.
        ("redis://:p@ss/w0rd@redis:6379/0", "redis://:***@redis:6379/0"),
        (
            "sentinel://:s3cret@h1:26379;sentinel://:s3cret@h2:26379;sentinel://h3:26379",
            "sentinel://:***@h1:26379;sentinel://:***@h2:26379;sentinel://h3:26379",
        ),
        (
            "redis+sentinel://:s3cret@h1:26379,h2:26379/mymaster/0",
            "redis+sentinel://:***@h1:26379,h2:26379/mymaster/0",
        ),
        ("unix:///tmp/redis.sock?db=0&password=s3cret", "unix:///tmp/redis.sock?db=0&password=***"),
        ("redis://h:6379/0?password=s3cret&db=2", "redis://h:6379/0?password=***&db=2"),
        (
            "carpool.celery_edge.results:CarpoolRedisBackend+redis://u:s3cret@h/1",
            "carpool.celery_edge.results:CarpoolRedisBackend+redis://u:***@h/1",
        ),
        ("not a url", "not a url"),
        # A ';' in a password (unescaped) is no list of hosts.
        ("redis://:s3cr;et@redis:6379/0", "redis://:***@redis:6379/0"),
        ("redis://u:a;b;c@redis:abc/0?x=1", "redis://u:***@redis:abc/0?x=1"),
    ],
)
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected
    assert "s3cret" not in redact_url(url)


def test_celery_report_masks_the_password_on_every_sentinel_address() -> None:
    """Celery masks a URL's first address only; carpool's sentinel URLs carry it on each."""
    from carpool.celery_edge.app import create_app
    from carpool.config import Settings

    sentinels = "sentinel://:topsecret@s1:26379;sentinel://s2:26379;sentinel://s3:26379"
    app = create_app(
        Settings(sentinel_master="m", broker_url=f"{sentinels}/0", result_backend=f"{sentinels}/1")
    )
    report = app.bugreport()
    assert "topsecret" not in report
    assert "sentinel://:********@s3:26379/1" in report  # the last address of the results' URL

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
        ("CARPOOL_BROKER_URL", "unix:///run/redis.sock", "redis://localhost:6379/0"),
        ("CARPOOL_RESULT_BACKEND", "unix:///run/redis.sock?db=1", "Unix socket (unix://) is not supported"),
        ("CARPOOL_MODEL", "no such model", "package.module:ClassName"),
        ("CARPOOL_RECOVERY_TIMEOUT_S", "600", "less than or equal to 60"),
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

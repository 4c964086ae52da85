"""The process harness of demo, bench and these tests: its own Redis, children with their own
environment, logs per child, one child stopped, killed or restarted without touching the others."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import redis

from carpool.tools.embedded import EmbeddedRedis
from carpool.tools.harness import Harness, ProcessExited

# Children that need no carpool: one that waits, one that fails at once with a message.
SLEEPER = ["timeit", "-n", "1", "-r", "1", "import time; time.sleep(60)"]
FAILING = ["json.tool", "/nonexistent/carpool-harness-test.json"]


def test_children_get_their_own_environment_and_the_parent_keeps_its_own(tmp_path: Path) -> None:
    before = dict(os.environ)
    with Harness(log_dir=tmp_path, base_env={"PATH": os.environ.get("PATH", "")}) as harness:
        assert harness.embedded and harness.server is not None
        env = harness.env(CARPOOL_MODEL="toy")
        assert env["CARPOOL_BROKER_URL"] == harness.server.url(0) == harness.broker_url
        assert env["CARPOOL_RESULT_BACKEND"] == harness.server.url(1) == harness.result_backend
        assert env["CARPOOL_MODEL"] == "toy" and "CARPOOL_TEST_REDIS_PORT" not in env
        assert harness.redis_client(0).ping()
        server = harness.server
    assert dict(os.environ) == before
    assert server.process is not None and server.process.poll() is not None  # its own server stopped


def test_stop_kill_and_restart_one_child(tmp_path: Path) -> None:
    with Harness(log_dir=tmp_path) as harness:
        first = harness.spawn("a", SLEEPER)
        harness.spawn("b", SLEEPER)
        with pytest.raises(ValueError, match="already running"):
            harness.spawn("a", SLEEPER)
        assert harness.kill("a") == -signal.SIGKILL
        assert set(harness.procs) == {"b"} and first.poll() is not None
        harness.spawn("a", SLEEPER)
        restarted = harness.restart("a")
        assert restarted.pid != first.pid and restarted.poll() is None
        harness.check_alive()
        assert set(harness.pids()) == {"a", "b", "redis-server"}
        harness.stop_all()
        assert harness.procs == {} and restarted.poll() is not None and harness.stop("b") is None
    assert (tmp_path / "a.log").exists() and (tmp_path / "b.log").exists()


def test_a_child_that_exits_early_is_reported_with_its_log(tmp_path: Path) -> None:
    with Harness(log_dir=tmp_path) as harness:
        proc = harness.spawn("broken", FAILING)
        proc.wait(timeout=30)
        with pytest.raises(ProcessExited, match=r"(?s)broken exited with 2.*carpool-harness-test"):
            harness.wait_workers(1, timeout_s=30)
        assert "carpool-harness-test" in harness.log("broken")


def test_an_external_redis_is_used_as_given(tmp_path: Path, redis_server: EmbeddedRedis) -> None:
    url = redis_server.url(0)
    with Harness(log_dir=tmp_path, broker_url=url) as harness:
        assert not harness.embedded and harness.server is None
        assert harness.broker_url == harness.result_backend == url
        assert harness.env()["CARPOOL_BROKER_URL"] == url
        with pytest.raises(TimeoutError):
            harness.wait_workers(1, timeout_s=0.3, request_queue="carpool.harness-test")


def test_an_embedded_server_on_a_port_another_server_holds_is_refused(redis_server: EmbeddedRedis) -> None:
    # The other server answers on the port too: only the answer of the server started may count.
    second = EmbeddedRedis(port=redis_server.port)
    try:
        with pytest.raises(RuntimeError, match=r"another server \(pid \d+\) holds it"):
            second.start()
    finally:
        second.cleanup()
    assert redis.Redis(port=redis_server.port).ping()  # the server already there is left alone

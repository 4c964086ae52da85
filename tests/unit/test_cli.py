"""``carpool worker``'s Celery options: passed on as given, or refused when carpool's worker sets them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from carpool.cli import celery_worker_options, main
from carpool.errors import ConfigError


def test_celery_options_carpool_does_not_set_pass_on_in_order() -> None:
    given = ["-O", "fair", "--pidfile=/tmp/w.pid", "--without-heartbeat", "-l", "debug", "-E"]
    assert celery_worker_options(given) == given
    # What carpool sets anyway is accepted, and goes without saying.
    assert celery_worker_options(["--pool", "solo", "-c", "1", "-O", "fair"]) == ["-O", "fair"]
    assert celery_worker_options([]) == []


@pytest.mark.parametrize(
    ("given", "named", "advice"),
    [
        (["-P", "prefork"], "--pool prefork", "one `carpool worker` per GPU"),
        (["--pool=threads"], "--pool threads", "one `carpool worker` per GPU"),
        (["-Pgevent"], "--pool gevent", "solo pool"),
        (["-c", "4"], "--concurrency 4", "one `carpool worker` per GPU"),
        (["--concurrency=2"], "--concurrency 2", "solo pool"),
        (["--autoscale", "4,1"], "--autoscale 4,1", "one `carpool worker` per GPU"),
        (["--max-tasks-per-child", "10"], "--max-tasks-per-child 10", "prefork pool's children"),
        (["-Q", "mine"], "--queues mine", "CARPOOL_SERVE_TASKS"),
        (["-X", "gpu.a"], "--exclude-queues gpu.a", "--tasks"),
        (["-O", "fair", "-n", "me@host"], "--hostname me@host", "carpool-gpu-<pid>@<host>"),
    ],
)
def test_an_option_carpool_sets_itself_is_refused_naming_it_and_what_to_do(
    given: list[str], named: str, advice: str
) -> None:
    with pytest.raises(ConfigError) as info:
        celery_worker_options(given)
    assert named in str(info.value)
    assert advice in str(info.value)


def test_carpool_worker_refuses_before_starting_anything(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "--loglevel", "info", "--pool", "prefork"]) == 2
    assert "celery worker option --pool prefork refused" in capsys.readouterr().err
    # As a process, with a broker nobody listens on: a worker that started would retry connecting
    # to it for good; the refusal comes first.
    run = subprocess.run(
        [sys.executable, "-m", "carpool", "worker", "-c", "8"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CARPOOL_BROKER_URL": "redis://127.0.0.1:1/0"},
    )
    assert run.returncode == 2
    assert "celery worker option --concurrency 8 refused" in run.stderr


def test_other_commands_still_refuse_options_they_do_not_know() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "carpool", "coordinator", "--pool", "solo"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert "unrecognized arguments: --pool solo" in run.stderr

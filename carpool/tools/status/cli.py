"""``carpool status``'s options: a live view, or one snapshot as text (``--once``) or JSON (``--json``)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import redis

from carpool.cli import at_least_one
from carpool.config import redact_url
from carpool.redis_edge.connect import client_for, deployment_hint, missing_database
from carpool.redis_edge.keys import Keys
from carpool.tools.status.snapshot import Rates, Snapshot, as_dict, collect, dead_letters, rates
from carpool.tools.status.view import render, render_dead_letters

DEFAULT_INTERVAL_S = 1.0
DEFAULT_DEAD_LETTERS = 20


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``status`` on the ``carpool`` command's subparsers."""
    import carpool.tools.status as package

    p: argparse.ArgumentParser = subparsers.add_parser(
        "status",
        help="live view of queue depth, workers, rates, padding, failures (from Redis)",
        description=package.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _arguments(p)
    p.set_defaults(func=run_cli)
    return p


def seconds(text: str) -> float:
    """An argparse type for ``--interval``: finite seconds, 0 or more (0: one sample, no rates)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text!r}")
    return value


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--interval",
        type=seconds,
        default=DEFAULT_INTERVAL_S,
        help="seconds between refreshes, and the window rates are measured over (default 1)",
    )
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit (implies --once)")
    p.add_argument(
        "--dead-letters",
        nargs="?",
        const=DEFAULT_DEAD_LETTERS,
        type=at_least_one,
        metavar="N",
        help=(
            f"print the newest N dead letters (default {DEFAULT_DEAD_LETTERS}): messages in the request"
            " queue that were no carpool request, with why, when and the start of each; with --json,"
            " as a JSON list"
        ),
    )


def run_cli(args: argparse.Namespace) -> int:
    from carpool.config import load_settings

    settings = load_settings()  # ConfigError propagates: the CLI prints it and exits 2
    interval = float(args.interval)
    keys = Keys(settings.request_queue)
    client = client_for(settings.broker_url, settings, socket_connect_timeout=5, socket_timeout=5)
    try:
        if args.dead_letters is not None:
            return _print_dead_letters(
                client, keys, settings.request_queue, settings.broker_url, args.dead_letters, bool(args.json)
            )
        if args.json or args.once:
            return _print_once(
                client, keys, settings.request_queue, settings.broker_url, interval, as_json=bool(args.json)
            )
        return _live(
            client, keys, settings.request_queue, settings.broker_url, interval or DEFAULT_INTERVAL_S
        )
    finally:
        client.close()


def _sample(client: redis.Redis, keys: Keys, interval: float) -> tuple[Snapshot, Rates | None]:
    first = collect(client, keys)
    if interval <= 0:
        return first, None
    time.sleep(interval)
    second = collect(client, keys)
    return second, rates(first, second)


def _print_dead_letters(
    client: redis.Redis, keys: Keys, queue: str, broker: str, limit: int, as_json: bool
) -> int:
    try:
        letters = dead_letters(client, keys, limit)
    except redis.RedisError as exc:
        return _unavailable(exc, broker)
    if as_json:
        print(json.dumps(letters, indent=2))
        return 0
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    console.print(render_dead_letters(letters, queue, broker, keys.dead_letter))
    return 0


def _unavailable(exc: redis.RedisError, broker: str) -> int:
    """Say why Redis refused or failed a read; 2 where a setting is to change, 1 for an outage."""
    hint = deployment_hint(exc, "CARPOOL_BROKER_URL")
    missing = missing_database(exc, "CARPOOL_BROKER_URL")
    if missing is not None:
        hint = str(missing)
    elif isinstance(exc, redis.exceptions.NoPermissionError):
        hint = (
            f"Redis refused a command status reads with ({exc}): carpool status reads every queue and"
            " coordinator key, which no role of `carpool acl` may; run it as the default user"
            " (docs/OPERATIONS.md)"
        )
    if hint is not None:  # a setting to change, not an outage to wait out
        print(f"carpool status: {redact_url(broker)}: {hint}", file=sys.stderr)
        return 2
    print(f"carpool status: redis unavailable at {redact_url(broker)}: {exc}", file=sys.stderr)
    return 1


def _print_once(
    client: redis.Redis, keys: Keys, queue: str, broker: str, interval: float, as_json: bool
) -> int:
    try:
        snap, rate = _sample(client, keys, interval)
    except redis.RedisError as exc:
        return _unavailable(exc, broker)
    if as_json:
        print(json.dumps(as_dict(snap, rate, queue), indent=2, sort_keys=True))
        return 0
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=120)  # piped into a file or a script: wide enough for one line a row
    console.print(render(snap, rate, queue, broker))
    return 0


def _live(client: redis.Redis, keys: Keys, queue: str, broker: str, interval: float) -> int:
    from rich.console import Console
    from rich.live import Live

    console = Console()
    previous: Snapshot | None = None
    with Live(
        render(None, None, queue, broker),
        console=console,
        refresh_per_second=4,
        screen=False,
    ) as live:
        try:
            while True:
                try:
                    snap = collect(client, keys)
                except redis.RedisError as exc:
                    previous = None
                    error = deployment_hint(exc, "CARPOOL_BROKER_URL") or str(exc)
                    live.update(render(None, None, queue, broker, error))
                else:
                    rate = rates(previous, snap) if previous is not None else None
                    live.update(render(snap, rate, queue, broker))
                    previous = snap
                time.sleep(interval)
        except KeyboardInterrupt:
            return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m carpool.tools.status``: the same command without the rest of the CLI."""
    import carpool.tools.status as package
    from carpool.errors import ConfigError

    parser = argparse.ArgumentParser(
        prog="carpool status",
        description=package.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _arguments(parser)
    try:
        return run_cli(parser.parse_args(argv))
    except ConfigError as exc:
        print(f"carpool: {exc}", file=sys.stderr)
        return 2

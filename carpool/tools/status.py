"""``carpool status``: a live terminal view of one carpool deployment, read from Redis.

Everything shown comes from Redis, so it works from any machine that reaches the broker and needs
neither torch nor a metrics port:

* queue depth: the request lists ``.delay()`` writes to (one per priority step), plus what the
  coordinator holds (``pending``, and per length bin from ``depth:<model>:<bin>`` fields);
* workers online: the heartbeat ZSET ``carpool:<queue>:workers`` (members with a live expiry);
* rates: deltas of the coordinator's counters (``carpool:<queue>:stats``) over the refresh interval;
* padding ratio, flush reasons, failures, batch sizes, in-flight requests, dead-letter length.

``--once`` prints one snapshot and exits (for scripts); ``--json`` prints it as JSON. Both sample the
counters twice, ``--interval`` apart, so rates are real; ``--interval 0`` skips rates.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from carpool.config import redact_url
from carpool.redis_edge.keys import PRIORITY_SEP, Keys

DEFAULT_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Snapshot:
    """What Redis says about one deployment at one moment."""

    taken_at: float  # monotonic seconds, for rates
    redis_time: float  # Redis clock, seconds
    queued: dict[str, int]  # request list label ("p0", "p3", ...) -> length
    workers: list[str]  # hostnames with a live heartbeat
    in_flight: int
    dead_letter: int
    stats: dict[str, float]  # the coordinator's counters, as written

    # --- derived -----------------------------------------------------------------------------
    def counter(self, name: str) -> float:
        return self.stats.get(name, 0.0)

    @property
    def queued_total(self) -> int:
        return sum(self.queued.values())

    @property
    def pending(self) -> int:
        return int(self.counter("pending"))

    @property
    def has_coordinator_stats(self) -> bool:
        return bool(self.stats)

    def prefixed(self, prefix: str) -> dict[str, float]:
        return {k[len(prefix) :]: v for k, v in self.stats.items() if k.startswith(prefix)}

    @property
    def depth_by_bin(self) -> dict[tuple[str, str], int]:
        """``depth:<model>:<bin label>`` fields; a model name may itself contain ':' (module:Class)."""
        out: dict[tuple[str, str], int] = {}
        for key, value in self.prefixed("depth:").items():
            model, sep, label = key.rpartition(":")
            if sep:
                out[(model, label)] = int(value)
        return out

    @property
    def padding_ratio(self) -> float | None:
        real = self.counter("real_tokens")
        return self.counter("padded_tokens") / real if real else None

    @property
    def mean_batch_size(self) -> float | None:
        batches = self.counter("batches")
        return self.counter("dispatched") / batches if batches else None


@dataclass(frozen=True)
class Rates:
    """Per-second rates between two snapshots; None where a counter went back (stats hash reset)."""

    seconds: float
    values: dict[str, float | None] = field(default_factory=dict)
    padding_ratio: float | None = None


RATE_COUNTERS = ("taken", "dispatched", "batches", "real_tokens", "padded_tokens")


def rates(before: Snapshot, after: Snapshot) -> Rates:
    dt = after.taken_at - before.taken_at
    if dt <= 0:
        return Rates(0.0)
    values: dict[str, float | None] = {}
    for name in RATE_COUNTERS:
        delta = after.counter(name) - before.counter(name)
        values[name] = delta / dt if delta >= 0 else None
    failed_delta = sum(after.prefixed("failed:").values()) - sum(before.prefixed("failed:").values())
    values["failed"] = failed_delta / dt if failed_delta >= 0 else None
    real = after.counter("real_tokens") - before.counter("real_tokens")
    padded = after.counter("padded_tokens") - before.counter("padded_tokens")
    return Rates(dt, values, padded / real if real > 0 and padded >= 0 else None)


def _list_label(keys: Keys, name: str) -> str:
    if name == keys.request_queue:
        return "p0"
    return "p" + name.rsplit(PRIORITY_SEP, 1)[-1]


def collect(client: redis.Redis, keys: Keys) -> Snapshot:
    """One consistent-enough read: two round trips, read-only."""
    secs, micros = client.time()
    now_ms = int(secs) * 1000 + int(micros) // 1000
    lists = keys.request_lists
    with client.pipeline(transaction=False) as pipe:
        for name in lists:
            pipe.llen(name)
        pipe.zrangebyscore(keys.workers, now_ms, "+inf")
        pipe.zcard(keys.inflight_lease)
        pipe.llen(keys.dead_letter)
        pipe.hgetall(keys.stats)
        replies = pipe.execute()
    n = len(lists)
    queued = {_list_label(keys, name): int(length) for name, length in zip(lists, replies[:n], strict=True)}
    workers, in_flight, dead, raw_stats = replies[n:]
    stats: dict[str, float] = {}
    for k, v in raw_stats.items():
        try:
            stats[_text(k)] = float(v)
        except ValueError:
            continue
    return Snapshot(
        taken_at=time.monotonic(),
        redis_time=now_ms / 1000,
        queued=queued,
        workers=sorted(_text(w) for w in workers),
        in_flight=int(in_flight),
        dead_letter=int(dead),
        stats=stats,
    )


def _text(value: bytes | str) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


# --- plain data (--json) ------------------------------------------------------------------------
def as_dict(snap: Snapshot, rate: Rates | None, queue: str) -> dict[str, Any]:
    s = snap.counter
    return {
        "request_queue": queue,
        "queued": snap.queued_total,
        "queued_by_priority": snap.queued,
        "pending": snap.pending,
        "depth_by_bin": {f"{m}:{b}": n for (m, b), n in sorted(snap.depth_by_bin.items())},
        "in_flight": snap.in_flight,
        "outstanding_batches": int(s("outstanding")),
        "workers_online": len(snap.workers),
        "workers": snap.workers,
        "dead_letter": snap.dead_letter,
        "taken": int(s("taken")),
        "batches": int(s("batches")),
        "dispatched": int(s("dispatched")),
        "padded_tokens": int(s("padded_tokens")),
        "real_tokens": int(s("real_tokens")),
        "padding_ratio": snap.padding_ratio,
        "mean_batch_size": snap.mean_batch_size,
        "batch_sizes": {k: int(v) for k, v in sorted(snap.prefixed("size:").items(), key=_num_key)},
        "flush": {k: int(v) for k, v in sorted(snap.prefixed("flush:").items())},
        "failed": {k: int(v) for k, v in sorted(snap.prefixed("failed:").items())},
        "coordinator_seen": snap.has_coordinator_stats,
        "rates": None
        if rate is None
        else {"seconds": rate.seconds, **rate.values, "padding_ratio": rate.padding_ratio},
    }


def _num_key(item: tuple[str, float]) -> tuple[int, str]:
    key = item[0]
    return (int(key), key) if key.isdigit() else (sys.maxsize, key)


# --- rich view -----------------------------------------------------------------------------------
def _fmt_rate(value: float | None, unit: str) -> str:
    if value is None:
        return "[yellow]reset[/]"
    return f"{value:,.1f} {unit}/s"


def _fmt_counts(counts: Mapping[str, float], style: str = "") -> str:
    items = [(k, int(v)) for k, v in counts.items() if v]
    if not items:
        return "[dim]none[/]"
    text = "  ".join(f"{k}={v:,}" for k, v in items)
    return f"[{style}]{text}[/]" if style else text


def render(
    snap: Snapshot | None, rate: Rates | None, queue: str, broker: str, error: str | None = None
) -> Any:
    """A rich renderable of one snapshot (with rates when there are two); about 15 lines tall."""
    from rich.columns import Columns
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    title = f"[bold]carpool status[/]  [dim]{queue} on {redact_url(broker)}[/]"
    if snap is None:
        body = f"[red]redis unavailable:[/] {error}" if error else "[dim]connecting...[/]"
        return Panel(body, title=title, title_align="left", border_style="red" if error else "dim")

    now = Table.grid(padding=(0, 2))
    now.title, now.title_justify, now.title_style = "now", "left", "bold underline"
    now.add_column(style="bold", no_wrap=True)
    now.add_column()
    w = len(snap.workers)
    names = ", ".join(snap.workers[:4]) + (f" +{w - 4}" if w > 4 else "")
    now.add_row("workers online", f"[{'green' if w else 'red'}]{w}[/]" + (f"  [dim]{names}[/]" if w else ""))
    by_prio = "  ".join(f"{k}={v:,}" for k, v in snap.queued.items() if v)
    now.add_row("queued", f"{snap.queued_total:,}" + (f"  [dim]{by_prio}[/]" if by_prio else ""))
    now.add_row("pending in coordinator", f"{snap.pending:,}")
    now.add_row("in flight", f"{snap.in_flight:,}  [dim]{int(snap.counter('outstanding'))} batches out[/]")
    now.add_row("dead letter", f"[{'red' if snap.dead_letter else 'dim'}]{snap.dead_letter:,}[/]")
    if rate is not None and rate.seconds > 0:
        v = rate.values
        now.add_row(
            "requests",
            f"{_fmt_rate(v.get('taken'), 'req')}  [dim]dispatched {_fmt_rate(v.get('dispatched'), 'req')}[/]",
        )
        now.add_row("batches", _fmt_rate(v.get("batches"), "batch"))
        pr = rate.padding_ratio
        now.add_row(
            "padding now",
            "[dim]-[/]" if pr is None else f"{pr:.2f}  [dim]{_fmt_rate(v.get('real_tokens'), 'real tok')}[/]",
        )
        failing = v.get("failed")
        if failing:
            now.add_row("failing", f"[red]{_fmt_rate(failing, 'req')}[/]")
    else:
        now.add_row("rates", "[dim]need two samples (--interval > 0)[/]")

    totals = Table.grid(padding=(0, 2))
    totals.title, totals.title_justify = "totals [dim](all coordinators)[/]", "left"
    totals.title_style = "bold underline"
    totals.add_column(style="bold", no_wrap=True)
    totals.add_column()
    if not snap.has_coordinator_stats:
        totals.add_row("coordinator", "[yellow]no counters yet: is a coordinator running?[/]")
    totals.add_row("taken", f"{int(snap.counter('taken')):,}")
    totals.add_row("dispatched", f"{int(snap.counter('dispatched')):,}")
    mean = snap.mean_batch_size
    totals.add_row(
        "batches",
        f"{int(snap.counter('batches')):,}" + (f"  [dim]mean size {mean:.1f}[/]" if mean is not None else ""),
    )
    sizes = _size_buckets(snap.prefixed("size:"))
    if sizes:
        totals.add_row("batch sizes", f"[dim]{sizes}[/]")
    ratio = snap.padding_ratio
    totals.add_row(
        "padding ratio",
        "[dim]-[/]"
        if ratio is None
        else f"{ratio:.2f}  [dim]{int(snap.counter('padded_tokens')):,} padded / "
        f"{int(snap.counter('real_tokens')):,} real tokens[/]",
    )
    totals.add_row("flush reasons", _fmt_counts(snap.prefixed("flush:")))
    failed = snap.prefixed("failed:")
    totals.add_row("failures", _fmt_counts(failed, "red" if any(failed.values()) else ""))

    # Side by side when the terminal is wide enough, one under the other when not.
    parts: list[Any] = [Columns([now, totals], padding=(0, 6))]
    # Only bins with requests in them: with automatic bin edges, labels of refitted-away bins linger
    # in the stats hash at 0.
    by_model: dict[str, list[tuple[str, int]]] = {}
    for (model, label), n in snap.depth_by_bin.items():
        if n:
            by_model.setdefault(model, []).append((label, n))
    if snap.depth_by_bin:
        bins = Table.grid(padding=(0, 2))
        bins.add_column(style="bold", no_wrap=True)
        bins.add_column()
        for model in sorted(by_model):
            cells = sorted(by_model[model], key=lambda c: _bin_order(c[0]))
            bins.add_row(model, "  ".join(f"{label}: {n:,}" for label, n in cells))
        if not by_model:
            bins.add_row("[dim]none waiting[/]", "")
        parts += ["", "[bold underline]waiting per length bin[/] [dim](tokens)[/]", bins]
    return Panel(Group(*parts), title=title, title_align="left", expand=False)


def _size_buckets(sizes: Mapping[str, float]) -> str:
    """Batch sizes in power-of-two buckets: ``1:3  2-3:5  4-7:12 ...`` (empty buckets left out)."""
    buckets: dict[int, int] = {}
    for key, count in sizes.items():
        if key.isdigit() and count:
            size = int(key)
            buckets[size.bit_length()] = buckets.get(size.bit_length(), 0) + int(count)
    parts = []
    for bits in sorted(buckets):
        low, high = 1 << (bits - 1), (1 << bits) - 1
        parts.append(f"{low if low == high else f'{low}-{high}'}:{buckets[bits]:,}")
    return "  ".join(parts)


def _bin_order(label: str) -> int:
    head = label.split("-", 1)[0].rstrip("+")
    return int(head) if head.isdigit() else sys.maxsize


# --- command ---------------------------------------------------------------------------------------
def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``status`` on the ``carpool`` command's subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "status",
        help="live view of queue depth, workers, rates, padding, failures (from Redis)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _arguments(p)
    p.set_defaults(func=run_cli)
    return p


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        help="seconds between refreshes, and the window rates are measured over (default 1)",
    )
    p.add_argument("--once", action="store_true", help="print one snapshot and exit")
    p.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit (implies --once)")


def run_cli(args: argparse.Namespace) -> int:
    from carpool.config import load_settings

    settings = load_settings()  # ConfigError propagates: the CLI prints it and exits 2
    interval = max(0.0, float(args.interval))
    keys = Keys(settings.request_queue)
    client = redis.Redis.from_url(settings.broker_url, socket_connect_timeout=5, socket_timeout=5)
    try:
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


def _print_once(
    client: redis.Redis, keys: Keys, queue: str, broker: str, interval: float, as_json: bool
) -> int:
    try:
        snap, rate = _sample(client, keys, interval)
    except redis.RedisError as exc:
        print(f"carpool status: redis unavailable at {redact_url(broker)}: {exc}", file=sys.stderr)
        return 1
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
                    live.update(render(None, None, queue, broker, str(exc)))
                else:
                    rate = rates(previous, snap) if previous is not None else None
                    live.update(render(snap, rate, queue, broker))
                    previous = snap
                time.sleep(interval)
        except KeyboardInterrupt:
            return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m carpool.tools.status``: the same command without the rest of the CLI."""
    from carpool.errors import ConfigError

    parser = argparse.ArgumentParser(
        prog="carpool status", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    _arguments(parser)
    try:
        return run_cli(parser.parse_args(argv))
    except ConfigError as exc:
        print(f"carpool: {exc}", file=sys.stderr)
        return 2


def snapshot_dict(settings: Any = None) -> dict[str, Any]:
    """One snapshot as plain data (no rates), for code that wants numbers rather than a view."""
    from carpool.config import load_settings

    settings = settings or load_settings()
    client = redis.Redis.from_url(settings.broker_url)
    try:
        return as_dict(collect(client, Keys(settings.request_queue)), None, settings.request_queue)
    finally:
        client.close()


__all__ = [
    "Rates",
    "Snapshot",
    "add_parser",
    "as_dict",
    "collect",
    "main",
    "rates",
    "render",
    "run_cli",
    "snapshot_dict",
]

if __name__ == "__main__":
    sys.exit(main())

"""``carpool status``'s rich view of one snapshot, with rates when there are two."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from carpool.config import redact_url
from carpool.tools.status.snapshot import Rates, Snapshot

_RAW_SHOWN = 200  # characters of a dead letter's message shown in the table (--json has the rest kept)


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
    c = len(snap.coordinators)
    held = int(snap.counter("deferred"))
    now.add_row(
        "pending in coordinator",
        f"{snap.pending:,}"
        + (f"  [dim]+{held:,} held for countdown/eta[/]" if held else "")
        + (f"  [dim]{c} coordinators[/]" if c > 1 else ""),
    )
    if snap.coordinators_disagree:
        differing = "; ".join(f"{name}: {serves}" for name, serves in sorted(snap.serves.items()))
        now.add_row(
            "coordinators disagree",
            f"[red]they serve different models or tasks[/]  [dim]{differing}; give them all the same"
            " CARPOOL_MODEL, CARPOOL_MODELS and CARPOOL_IMPORTS[/]",
        )
    if len(snap.batch_queues) > 1 or snap.unserved or snap.unsaid:
        queues = "  ".join(_queue_cell(snap, q, hosts) for q, hosts in snap.batch_queues.items())
        if snap.unsaid:  # they may consume any of them
            queues += f"  [dim]+{len(snap.unsaid)} worker(s) of an earlier release: queues unknown[/]"
        now.add_row("batch queues", queues)
    if snap.unserved:
        now.add_row(
            "no worker",
            f"[red]{', '.join(snap.unserved)}[/]  [dim]coordinators send batches there, no live worker"
            " consumes it: start one that serves its tasks[/]",
        )
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
    # Taken again after going back, so counted in "taken" once more: none of them is lost.
    totals.add_row("requeued", _fmt_counts(snap.prefixed("requeued:")))

    # Side by side when the terminal is wide enough, one under the other when not.
    parts: list[Any] = [Columns([now, totals], padding=(0, 6))]
    # Only bins with requests in them: a bin that emptied stays in the gauges at 0.
    by_model: dict[str, list[tuple[str, int]]] = {}
    for (model, label), n in snap.depth_by_bin.items():
        if n:
            by_model.setdefault(model, []).append((label, n))
    if snap.depth_by_bin:
        bins = Table.grid(padding=(0, 2))
        bins.add_column(style="bold", no_wrap=True)  # the task
        bins.add_column(no_wrap=True)  # its routing key when that is not the task itself: infer's model
        bins.add_column()
        rows = sorted((snap.tasks.get(model, ""), model) for model in by_model)
        for task, model in rows:
            cells = sorted(by_model[model], key=lambda c: _bin_order(c[0]))
            shown = (task, "" if model == task else f"model={model}") if task else (model, "")
            bins.add_row(*shown, "  ".join(f"{_bin_name(snap, model, label)}: {n:,}" for label, n in cells))
        if not by_model:
            bins.add_row("[dim]none waiting[/]", "", "")
        parts += [
            "",
            "[bold underline]waiting per length bin[/] [dim](per task, and per model for infer)[/]",
            bins,
        ]
    return Panel(Group(*parts), title=title, title_align="left", expand=False)


def _queue_cell(snap: Snapshot, queue: str, hosts: list[str]) -> str:
    """A batch queue and how many live workers consume it (red when coordinators send there and none)."""
    if queue in snap.unserved:
        return f"{queue}=[red]0[/]"
    return f"{queue}={len(hosts)}"


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


def _bin_name(snap: Snapshot, model: str, label: str) -> str:
    """A bin's label, with the token lengths it holds now when the label does not say (automatic bins)."""
    span = snap.spans.get((model, label))
    return f"{label} ({span})" if span else label


def _bin_order(label: str) -> int:
    """Shortest first: fixed bins by their lowest length, automatic ones (``b0``...) by index."""
    head = label[1:] if label.startswith("b") else label.split("-", 1)[0].rstrip("+")
    return int(head) if head.isdigit() else sys.maxsize


def render_dead_letters(letters: list[dict[str, Any]], queue: str, broker: str, key: str) -> Any:
    """A rich table of dead letters, newest first: when, the id taken, why, and the message's start."""
    import datetime

    from rich.markup import escape
    from rich.table import Table

    table = Table(
        title=f"[bold]dead letters[/]  [dim]{queue} on {redact_url(broker)}, newest first ({key})[/]",
        title_justify="left",
        expand=True,
    )
    table.add_column("at (UTC)", no_wrap=True)
    table.add_column("id", overflow="fold", max_width=24)
    table.add_column("why", overflow="fold", ratio=2)
    table.add_column("message", overflow="fold", ratio=3)
    if not letters:
        table.add_row("", "", "[dim]none[/]", "")
    for letter in letters:
        at = letter.get("at")
        when = (
            datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
            if isinstance(at, int | float)
            else "[dim]?[/]"
        )
        raw = str(letter.get("raw", ""))
        size = letter.get("bytes")
        shown = escape(raw[:_RAW_SHOWN]) + ("…" if len(raw) > _RAW_SHOWN or letter.get("truncated") else "")
        if isinstance(size, int):
            shown += f" [dim]({size:,} bytes)[/]"
        table.add_row(when, escape(str(letter.get("id", ""))), escape(str(letter.get("reason", ""))), shown)
    return table

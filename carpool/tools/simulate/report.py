"""What ``carpool simulate`` shows: one sweep's results as a rich table and a matplotlib PNG."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from carpool.tools.simulate.engine import SimResult

if TYPE_CHECKING:
    from rich.table import Table


@dataclass(slots=True)
class Sweep:
    """Results of one CLI run: per offered rate, per policy."""

    rates: list[float]  # offered requests/s of each run, as realised by its arrivals
    results: list[dict[str, SimResult]]
    bound: float
    latency: tuple[float, float]
    workers: int
    description: str
    sorted_pass_s: float = 0.0  # model seconds of length-sorted batches of the same requests (0: unknown)


def results_table(sweep: Sweep) -> Table:
    """One row per offered rate and policy, a section per rate."""
    from rich.table import Table

    table = Table(
        title=f"carpool simulate: {sweep.description}\n"
        f"capacity bound {sweep.bound:.1f} req/s (full batches, no padding); "
        "device/sorted: model time of the batches / of length-sorted batches of the same requests"
    )
    for name, justify in (
        ("offered/s", "right"),
        ("policy", "left"),
        ("throughput/s", "right"),
        ("p50 ms", "right"),
        ("p99 ms", "right"),
        ("padding", "right"),
        ("device/sorted", "right"),
        ("mean batch", "right"),
        ("batches", "right"),
        ("misses", "right"),
        ("util", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for i, (rate, by_policy) in enumerate(zip(sweep.rates, sweep.results, strict=True)):
        if i:
            table.add_section()
        for kind, r in by_policy.items():
            table.add_row(
                f"{rate:.1f}",
                kind,
                f"{r.throughput:.1f}",
                _ms(r.p50_s),
                _ms(r.p99_s),
                f"{r.padding_ratio:.2f}",
                f"{r.device_s / sweep.sorted_pass_s:.3f}" if sweep.sorted_pass_s > 0 else "-",
                f"{r.mean_batch_size:.1f}",
                str(len(r.batches)),
                str(r.missed),
                f"{r.utilisation:.0%}",
            )
    return table


def _ms(seconds: float) -> str:
    # Whole milliseconds hide a cheap model's sub-millisecond latencies as "0".
    return f"{seconds * 1000:.0f}" if seconds >= 0.01 else f"{seconds * 1000:.2f}"


def plot(sweep: Sweep, out: Path) -> None:
    """p50/p99 latency, throughput and padding ratio per policy across offered rates, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    kinds = list(sweep.results[0])
    # A burst offers an infinite rate, which no axis holds: put such runs one step past the others.
    finite = [r for r in sweep.rates if math.isfinite(r)]
    past = max(finite, default=1.0) * 1.15
    # Lines join the runs left to right, whatever order the rates were given in.
    order = sorted(range(len(sweep.rates)), key=lambda i: sweep.rates[i])
    xs = [sweep.rates[i] if math.isfinite(sweep.rates[i]) else past for i in order]
    fig, (ax_lat, ax_thr, ax_pad) = plt.subplots(1, 3, figsize=(15, 4.6))
    colors = {"fifo": "tab:red", "shortest": "tab:orange", "binned": "tab:blue", "binned-arrival": "tab:cyan"}
    for kind in kinds:
        rs = [sweep.results[i][kind] for i in order]
        c = colors.get(kind)
        ax_lat.plot(xs, [r.p50_s * 1000 for r in rs], "o-", color=c, label=f"{kind} p50")
        ax_lat.plot(xs, [r.p99_s * 1000 for r in rs], "s--", color=c, label=f"{kind} p99")
        ax_thr.plot(xs, [r.throughput for r in rs], "o-", color=c, label=kind)
        ax_pad.plot(xs, [r.padding_ratio for r in rs], "o-", color=c, label=kind)
    if finite:
        top = max(finite)
        ax_thr.plot([0, top], [0, top], ":", color="grey", label="offered")
    ax_thr.axhline(sweep.bound, color="black", linestyle="-.", linewidth=1, label="capacity bound")
    ax_lat.set_yscale("log")
    xlabel = "offered requests/s" + (f" (burst at {past:.0f})" if len(finite) < len(xs) else "")
    ax_lat.set(title="latency", xlabel=xlabel, ylabel="ms (log)")
    ax_thr.set(title="throughput", xlabel=xlabel, ylabel="completed requests/s")
    ax_pad.set(title="padding ratio (padded / real tokens)", xlabel=xlabel, ylabel="ratio")
    for ax in (ax_lat, ax_thr, ax_pad):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(sweep.description, fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)

"""The soak's picture: throughput and p99 over time with each fault marked, memory below it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

FAULT_COLORS = {"coordinator": "#d62728", "worker": "#ff7f0e", "redis": "#9467bd"}
MIB = 1024 * 1024


def plot_soak(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wins = report["windows"]
    cfg = report["config"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, height_ratios=(3, 2))
    t = [w["t_s"] + cfg["window_s"] / 2 for w in wins]
    top.plot(t, [w["throughput_rps"] for w in wins], color="#1f77b4", label="answered / s")
    top.plot(
        t,
        [w["offered"] / cfg["window_s"] for w in wins],
        color="#1f77b4",
        alpha=0.35,
        ls=":",
        label="offered / s",
    )
    top.set_ylabel("requests / s")
    right = top.twinx()
    right.plot(t, [w["p99_ms"] for w in wins], color="#2ca02c", label="p99 latency")
    bound = report["latency_ms"].get("recovered_bound")
    if bound:
        right.axhline(bound, color="#2ca02c", ls="--", lw=0.8, label=f"recovered bound ({bound:.0f} ms)")
    right.set_yscale("log")
    right.set_ylabel("p99 latency per window (ms)")
    for fault in report["faults"]:
        for ax in (top, bottom):
            ax.axvline(fault["at_s"], color=FAULT_COLORS.get(fault["kind"], "k"), lw=1, alpha=0.7)
        top.annotate(
            fault["target"],
            (fault["at_s"], 1.0),
            xycoords=("data", "axes fraction"),
            rotation=90,
            va="top",
            ha="right",
            fontsize=7,
            color=FAULT_COLORS.get(fault["kind"], "k"),
        )
    lines = top.get_legend_handles_labels()
    more = right.get_legend_handles_labels()
    top.legend(lines[0] + more[0], lines[1] + more[1], loc="lower left", fontsize=8)
    counts = report["counts"]
    top.set_title(
        f"chaos soak: {counts['accepted']} requests at {cfg['rate_rps']:.0f}/s, {len(report['faults'])} "
        f"faults; lost {counts['lost']}, wrong {counts['wrong_result']}, "
        f"changed {counts['reread_changed']}",
        fontsize=10,
    )
    for name, lives in report["memory"]["processes"].items():
        first = True
        for life in lives:
            xs = [p[0] for p in life["samples"]]
            bottom.plot(
                xs,
                [p[1] / MIB for p in life["samples"]],
                lw=1,
                label=name if first else None,
                color=_color(name),
            )
            first = False
    used = report["memory"]["redis_used_memory"]["samples"]
    bottom.plot(
        [p[0] for p in used], [p[1] / MIB for p in used], color="k", ls="--", lw=1, label="redis used_memory"
    )
    bottom.set_ylabel("MiB (RSS)")
    bottom.set_xlabel(
        "seconds since the load started (fault lines: red coordinator, orange worker, purple redis)"
    )
    bottom.legend(fontsize=7, ncol=4, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _color(name: str) -> str:
    palette = {
        "coordinator0": "#e377c2",
        "coordinator1": "#8c564b",
        "worker0": "#17becf",
        "worker1": "#bcbd22",
        "redis-server": "#7f7f7f",
        "producer": "#aec7e8",
    }
    return palette.get(name, "#333333")

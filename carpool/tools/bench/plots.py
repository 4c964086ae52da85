"""PNG plots of a ``carpool bench`` report (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = {
    "carpool": "#1f77b4",
    "celery": "#d62728",
    "celery-batches": "#ff7f0e",
    "asyncio": "#2ca02c",
    "offline": "#7f7f7f",
}
ORDER = ("carpool", "celery-batches", "celery", "asyncio", "offline")


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _systems(runs: list[dict[str, Any]]) -> list[str]:
    present = {r["system"] for r in runs}
    return [s for s in ORDER if s in present] + sorted(present - set(ORDER))


def _rate_runs(runs: list[dict[str, Any]], system: str) -> list[dict[str, Any]]:
    return sorted(
        (r for r in runs if r["system"] == system and r["mode"] == "rate"), key=lambda r: r["offered_rps"]
    )


def write_plots(report: dict[str, Any], out_dir: Path) -> list[str]:
    """Write every plot the report has data for; returns the file names."""
    plt = _plt()
    written: list[str] = []
    runs = report["runs"]
    title = f"{report['model']}, {report['workload']['requests']} mixed-length requests"

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        written.append(name)

    offline = next((r for r in runs if r["system"] == "offline"), None)
    rated = [s for s in _systems(runs) if _rate_runs(runs, s)]

    if rated:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        top = 0.0
        for s in rated:
            pts = _rate_runs(runs, s)
            xs = [r["offered_rps"] for r in pts]
            ax.plot(xs, [r["throughput_rps"] for r in pts], "o-", color=COLORS.get(s), label=s)
            top = max(top, *xs)
            burst = next((r for r in runs if r["system"] == s and r["mode"] == "burst"), None)
            if burst:
                ax.axhline(burst["throughput_rps"], color=COLORS.get(s), ls=":", lw=1)
        if offline:
            ax.axhline(offline["throughput_rps"], color=COLORS["offline"], ls="--", label="offline limit")
        ax.plot([0, top], [0, top], color="#cccccc", lw=1, label="offered = served")
        ax.set_xlabel("offered load (requests/s, Poisson)")
        ax.set_ylabel("throughput (requests/s)")
        ax.set_title(f"Throughput vs offered load (dotted: burst)\n{title}", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        save(fig, "throughput_vs_load.png")

        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
        for ax, q in zip(axes, ("p50", "p99"), strict=True):
            for s in rated:
                pts = _rate_runs(runs, s)
                ax.plot(
                    [r["offered_rps"] for r in pts],
                    [max(r["latency_ms"][q], 1e-3) for r in pts],
                    "o-",
                    color=COLORS.get(s),
                    label=s,
                )
            ax.set_yscale("log")
            ax.set_xlabel("offered load (requests/s)")
            ax.set_title(f"{q} latency")
            ax.grid(alpha=0.3, which="both")
        axes[0].set_ylabel("latency (ms, log)")
        axes[0].legend(fontsize=8)
        fig.suptitle(f"Latency vs offered load -- {title}", fontsize=10)
        save(fig, "latency_vs_load.png")

    bursts = [r for r in runs if r["mode"] == "burst" and r.get("padding_ratio")]
    if bursts:
        bursts.sort(key=lambda r: ORDER.index(r["system"]) if r["system"] in ORDER else 99)
        fig, ax = plt.subplots(figsize=(7, 4))
        names = [r["system"] for r in bursts]
        values = [r["padding_ratio"] for r in bursts]
        ax.bar(names, values, color=[COLORS.get(n, "#999999") for n in names])
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.2f}", ha="center", va="bottom", fontsize=9)
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_ylabel("padded tokens / real tokens")
        ax.set_title(f"Padding ratio in the burst (1.0 = no padding)\n{title}", fontsize=10)
        save(fig, "padding_ratio.png")

    sized = [r for r in runs if r["mode"] == "burst" and r.get("batches") and r["batches"]["sizes"]]
    if sized:
        sized.sort(key=lambda r: ORDER.index(r["system"]) if r["system"] in ORDER else 99)
        fig, axes = plt.subplots(
            len(sized), 1, figsize=(7, 1.8 * len(sized) + 0.8), sharex=True, squeeze=False
        )
        for ax, r in zip(axes[:, 0], sized, strict=True):
            sizes = {int(k): v for k, v in r["batches"]["sizes"].items()}
            ax.bar(list(sizes), list(sizes.values()), color=COLORS.get(r["system"], "#999999"), width=0.8)
            ax.set_ylabel(r["system"], fontsize=8)
            ax.text(
                0.99,
                0.85,
                f"{r['batches']['count']} batches, mean {r['batches']['mean_size']:.1f}",
                transform=ax.transAxes,
                ha="right",
                fontsize=8,
            )
        axes[-1, 0].set_xlabel("batch size (requests)")
        fig.suptitle(f"Batch sizes in the burst -- {title}", fontsize=10)
        save(fig, "batch_sizes.png")

    pipeline = report.get("pipeline")
    if pipeline and pipeline.get("runs"):
        fig, ax = plt.subplots(figsize=(6, 4))
        names = [r["system"] for r in pipeline["runs"]]
        values = [r["throughput_rps"] for r in pipeline["runs"]]
        ax.bar(names, values, color=[COLORS.get(n, "#999999") for n in names])
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.0f}/s", ha="center", va="bottom", fontsize=9)
        ax.set_ylabel("requests/s")
        ax.set_title(f"Pipeline cost: null model, burst of {pipeline['requests']}", fontsize=10)
        save(fig, "pipeline_null_model.png")

    sweep = report.get("sweep")
    if sweep and sweep.get("points"):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        waits = sorted({p["max_wait_s"] for p in sweep["points"]})
        cmap = plt.get_cmap("viridis")
        for i, wait in enumerate(waits):
            pts = sorted(
                (p for p in sweep["points"] if p["max_wait_s"] == wait), key=lambda p: p["max_batch"]
            )
            xs, ys, labels = [], [], []
            for p in pts:
                b_run = next((r for r in p["runs"] if r["mode"] == "burst"), None)
                r_run = next((r for r in p["runs"] if r["mode"] == "rate"), None)
                if b_run is None or r_run is None:
                    continue
                xs.append(b_run["throughput_rps"])
                ys.append(max(r_run["latency_ms"]["p99"], 1e-3))
                labels.append(str(p["max_batch"]))
            color = cmap(i / max(1, len(waits) - 1))
            ax.plot(xs, ys, "o-", color=color, label=f"max wait {wait * 1000:g} ms")
            for x, y, label in zip(xs, ys, labels, strict=True):
                ax.annotate(label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_yscale("log")
        rate = sweep.get("rate_rps") or 0.0
        ax.set_xlabel("capacity: burst throughput (requests/s)")
        ax.set_ylabel(f"p99 latency at {rate:.0f} requests/s offered (ms, log)")
        ax.set_title(f"carpool throughput-latency over max batch (labels) and max wait\n{title}", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, which="both")
        save(fig, "sweep_throughput_latency.png")
    return written


def _cores_panel(ax: Any, over: dict[str, Any]) -> None:
    """Cores each component kept busy per bucket, stacked, under the machine's core count."""
    width = over["bucket_s"]
    names = list(over["components"])
    count = len(over["total"])
    xs = [i * width for i in range(count + 1)]
    stacks = [[*over["components"][n][:count], over["components"][n][count - 1]] for n in names]
    ax.stackplot(xs, *stacks, labels=names, step="post", alpha=0.8)
    cores = over.get("machine_cores")
    if cores:
        ax.axhline(cores, color="#7f7f7f", ls="--", lw=1, label=f"{cores} cores")
    ax.set_ylim(0, max([float(cores or 0), *over["total"]]) * 1.1 or 1.0)
    ax.set_xlabel("seconds since submit_many was called")
    ax.set_ylabel(f"cores busy (per {width:g} s)")
    ax.legend(fontsize=8, loc="upper right", ncol=len(names) + 1)
    ax.grid(alpha=0.3)


def write_accelerator_plots(report: dict[str, Any], out_dir: Path) -> list[str]:
    """The plots of ``carpool bench --accelerator``: the device's busy fraction over the run, and
    CPU per request by component; returns the file names."""
    plt = _plt()
    written: list[str] = []
    title = f"{report['model']}, {report['workload']['requests']} mixed-length texts"
    busy = report.get("device_busy")
    carpool = report.get("carpool") or {}
    if busy and busy.get("buckets"):
        width = busy["bucket_s"]
        series = busy["buckets"]
        over = report.get("cpu_over_run")
        if over and over.get("total"):
            fig, (ax, cpu_ax) = plt.subplots(2, 1, figsize=(8, 6.4), sharex=True, height_ratios=(1, 1.2))
            _cores_panel(cpu_ax, over)
        else:
            fig, ax = plt.subplots(figsize=(8, 3.8))
        ax.step(
            [i * width for i in range(len(series) + 1)],
            [*series, series[-1]],
            where="post",
            color=COLORS["carpool"],
        )
        ax.fill_between(
            [i * width for i in range(len(series) + 1)],
            [*series, series[-1]],
            step="post",
            alpha=0.25,
            color=COLORS["carpool"],
        )
        if carpool.get("submit_s") is not None:
            ax.axvline(carpool["submit_s"], color="#7f7f7f", ls=":", lw=1, label="submit_many returned")
        ax.axhline(busy["overall"], color="#d62728", ls="--", lw=1, label=f"whole run {busy['overall']:.2f}")
        ax.set_ylim(0, 1.05)
        ax.set_xlim(0, busy["window_s"])
        if not over:
            ax.set_xlabel("seconds since submit_many was called")
        ax.set_ylabel(f"device busy fraction (per {width:g} s)")
        ratio = carpool.get("ratio_to_capacity")
        ax.set_title(
            f"Simulated device busy over the run ({'' if ratio is None else f'{ratio:.2f} x capacity; '}"
            f"{title})",
            fontsize=10,
        )
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / "device_busy.png", dpi=110)
        plt.close(fig)
        written.append("device_busy.png")
    cpu = carpool.get("cpu_us_per_request") or {}
    parts = [
        ("producer submit", cpu.get("producer_submit")),
        ("producer gather", cpu.get("producer_gather")),
        ("Redis", cpu.get("redis")),
        ("coordinator:\ntokenization", cpu.get("tokenization")),
        ("coordinator:\nthe rest", cpu.get("coordinator_besides_tokenization")),
        ("worker", cpu.get("worker")),
    ]
    if all(v is not None for _, v in parts):
        fig, ax = plt.subplots(figsize=(8, 3.8))
        names = [n for n, _ in parts]
        values = [max(0.0, float(v or 0.0)) for _, v in parts]
        ax.bar(names, values, color=COLORS["carpool"])
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=9)
        ax.set_ylabel("CPU µs per request")
        ax.set_title(f"CPU per request by component ({title})", fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "cpu_per_request.png", dpi=110)
        plt.close(fig)
        written.append("cpu_per_request.png")
    return written

"""The report of ``carpool bench --accelerator``: its schema, the issue's targets, rich tables.

Schema ``carpool-bench-accelerator/1``::

    {
      "schema", "created_at", "command", "machine" {..., "load_average", "load_average_end"},
      "model": "sim-v100" | "sim-h100" | "sim",
      "device": {"profile", "a_s", "b_s"},
      "config": {"requests", "seed", "max_batch", "max_wait_s", "workers", "coordinators", "light",
                 "pipeline", "noop_tasks", "quick", "gather_timeout_s", "profile", "redis",
                 "events"},
      "workload": {"requests", "seed", "length_distribution", "chars_mean", "token_lengths",
                   "at_window_share"},
      "tokenizer_cpu_us_per_text": float,        # in the bench's process, one thread (a reference)
      "capacity": {"texts_per_s", "device_s", "batches", "padded_tokens", "real_tokens", "padding_ratio"},
      "carpool": null | {"requests", "wall_s", "submit_s", "gather_s", "throughput_rps",
                         "ratio_to_capacity", "batches", "mean_batch", "padding_ratio",
                         "batching_efficiency", "cpu_us_per_request" {COMPONENTS...},
                         "tokenization_counted_by": "coordinator" | "bench",
                         "background_cpu_cores", "redis_commands_per_request", "wall_start"},
      "device_busy": null | {"bucket_s", "window_s", "devices", "forwards", "overall",
                             "while_working", "first_start_s", "last_end_s", "buckets": [float],
                             "buckets_p10_p50_p90", "device_s_nominal"},
      "cpu_over_run": absent | {"bucket_s", "machine_cores", "whole_run" {"total_cores", "cores"},
                                "components" {producer, coordinator, worker, redis: [cores per
                                bucket of device_busy]}, "total": [cores],
                                "device_waiting" | "device_saturated": {"buckets", "total_cores",
                                "cores"}},
      "pipeline": null | {"model": "null", "carpool": burst | null, "celery_noop": {...} | null,
                          "ratio": float | null},
      "light": null | {"requests", "latency_ms" {p50, p90, p99, mean, max}, ...},
      "targets": [{"name", "description", "target", "measured", "met"}],
      "plots": [file name], "errors": [{"phase", "error"}]
    }
"""

from __future__ import annotations

from typing import Any

from carpool.tools.bench.report import top_level_problems

SCHEMA = "carpool-bench-accelerator/1"

# The issue's throughput targets, carpool end to end / device capacity, per named profile.
RATIO_TARGETS = {"v100": 0.9, "h100": 0.30}

# (key in cpu_us_per_request, label); producer_total is submit + gather.
COMPONENTS = (
    ("producer_submit", "producer submit"),
    ("producer_gather", "producer gather"),
    ("redis", "Redis"),
    ("coordinator", "coordinator"),
    ("tokenization", "  tokenization (its prepare calls' thread CPU)"),
    ("coordinator_besides_tokenization", "  coordinator besides tokenization"),
    ("worker", "worker"),
)
CPU_TARGETS_US = {
    "worker": 40.0,
    "coordinator_besides_tokenization": 40.0,
    "redis": 30.0,
    "producer_total": 40.0,
}


def evaluate_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with what this run measured (null when it was not measured)."""
    targets: list[dict[str, Any]] = []

    def add(name: str, description: str, target: float, measured: float | None, higher: bool) -> None:
        met = None if measured is None else (measured >= target if higher else measured <= target)
        targets.append(
            {"name": name, "description": description, "target": target, "measured": measured, "met": met}
        )

    carpool = report.get("carpool") or {}
    profile = report["device"]["profile"]
    if profile in RATIO_TARGETS:
        add(
            "throughput_vs_device_capacity",
            f"carpool end to end / {profile} capacity on the same workload",
            RATIO_TARGETS[profile],
            carpool.get("ratio_to_capacity"),
            True,
        )
    cpu = carpool.get("cpu_us_per_request") or {}
    producer = cpu["producer_submit"] + cpu["producer_gather"] if "producer_submit" in cpu else None
    for key, limit in CPU_TARGETS_US.items():
        value = producer if key == "producer_total" else cpu.get(key)
        add(f"cpu_us_{key}", f"CPU µs per request, {key.replace('_', ' ')}", limit, value, False)
    pipeline = report.get("pipeline") or {}
    add(
        "null_pipeline_vs_plain_celery",
        "null model through submit_many + gather / plain Celery no-op tasks",
        15.0,
        pipeline.get("ratio"),
        True,
    )
    light = report.get("light") or {}
    latency = light.get("latency_ms") or {}
    add(
        "light_null_p50_ms",
        "a lone short request, null model: p50 round trip (ms)",
        3.0,
        latency.get("p50"),
        False,
    )
    add(
        "light_null_p99_ms",
        "a lone short request, null model: p99 round trip (ms)",
        10.0,
        latency.get("p99"),
        False,
    )
    return targets


def validate_report(report: Any) -> list[str]:
    """Problems with ``report`` against schema carpool-bench-accelerator/1 (empty when well-formed)."""
    problems, complete = top_level_problems(
        report,
        SCHEMA,
        (
            ("schema", str),
            ("created_at", str),
            ("machine", dict),
            ("model", str),
            ("device", dict),
            ("config", dict),
            ("workload", dict),
            ("capacity", dict),
            ("targets", list),
            ("plots", list),
            ("errors", list),
        ),
    )
    if not complete:
        return problems
    if not {"profile", "a_s", "b_s"} <= set(report["device"]):
        problems.append("device: profile / a_s / b_s missing")
    if not isinstance(report["capacity"].get("texts_per_s"), int | float):
        problems.append("capacity.texts_per_s missing")
    carpool = report.get("carpool")
    if carpool is not None:
        for key in ("throughput_rps", "ratio_to_capacity", "wall_s"):
            if not isinstance(carpool.get(key), int | float):
                problems.append(f"carpool.{key} missing")
        cpu = carpool.get("cpu_us_per_request") or {}
        missing = [k for k, _ in COMPONENTS if not isinstance(cpu.get(k), int | float)]
        if missing:
            problems.append(f"carpool.cpu_us_per_request lacks {', '.join(missing)}")
    busy = report.get("device_busy")
    if busy is not None:
        values = [busy.get("overall"), *busy.get("buckets", [])]
        if any(not isinstance(v, int | float) or not 0.0 <= v <= 1.0 for v in values):
            problems.append("device_busy: a fraction outside [0, 1]")
    over = report.get("cpu_over_run")
    if over is not None:
        series = [*over.get("components", {}).values(), over.get("total", [])]
        if any(not isinstance(v, int | float) or v < 0 for values in series for v in values):
            problems.append("cpu_over_run: cores must be numbers >= 0")
        if busy is not None and any(len(values) > len(busy.get("buckets", [])) for values in series):
            problems.append("cpu_over_run: more buckets than device_busy")
    for t in report["targets"]:
        if not {"name", "target", "measured", "met"} <= set(t):
            problems.append(f"target {t.get('name')!r} incomplete")
    return problems


def _num(value: Any, fmt: str = ".0f") -> str:
    return "-" if value is None else format(value, fmt)


def print_report(report: dict[str, Any], console: Any = None) -> None:
    """The report as rich tables on ``console`` (stdout by default)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    device = report["device"]
    wl = report["workload"]
    console.print(
        f"[bold]carpool bench --accelerator {device['profile']}[/bold]: model {report['model']}, "
        f"a = {device['a_s'] * 1e3:g} ms, b = {device['b_s'] * 1e6:g} µs/token; {wl['requests']} texts, "
        f"{wl['chars_mean']:.0f} characters and {wl['token_lengths'].get('mean', 0):.1f} tokens on average, "
        f"{wl['at_window_share']:.1%} at the window"
    )
    capacity, carpool = report["capacity"], report.get("carpool") or {}
    busy = report.get("device_busy") or {}
    table = Table(title="Throughput on the simulated device")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row(
        f"device capacity (sorted batches of {report['config']['max_batch']})",
        f"{capacity['texts_per_s']:,.0f} texts/s",
    )
    table.add_row(
        "carpool end to end (submit_many + gather)", f"{_num(carpool.get('throughput_rps'), ',.0f')} texts/s"
    )
    table.add_row("[bold]ratio[/bold]", f"[bold]{_num(carpool.get('ratio_to_capacity'), '.3f')}[/bold]")
    table.add_row(
        "submit / gather / total (s)",
        " / ".join(_num(carpool.get(k), ".2f") for k in ("submit_s", "gather_s", "wall_s")),
    )
    table.add_row(
        "padding: carpool's batches / sorted",
        f"{_num(carpool.get('padding_ratio'), '.2f')} / {capacity['padding_ratio']:.2f}",
    )
    table.add_row(
        "batches (mean size)",
        f"{_num(carpool.get('batches'), 'd')} ({_num(carpool.get('mean_batch'), '.1f')})",
    )
    table.add_row("device time, sorted / carpool's batches", _num(carpool.get("batching_efficiency"), ".3f"))
    table.add_row(
        "device busy: whole run / while it had work",
        f"{_num(busy.get('overall'), '.3f')} / {_num(busy.get('while_working'), '.3f')}",
    )
    quantiles = busy.get("buckets_p10_p50_p90")
    table.add_row(
        f"device busy per {busy.get('bucket_s', '-')} s: p10 / p50 / p90",
        " / ".join(f"{v:.2f}" for v in quantiles) if quantiles else "-",
    )
    console.print(table)

    cpu = carpool.get("cpu_us_per_request") or {}
    table = Table(title="CPU per request (µs, whole process trees)")
    table.add_column("component")
    table.add_column("µs", justify="right")
    table.add_column("target", justify="right")
    for key, label in COMPONENTS:
        table.add_row(label, _num(cpu.get(key), ".1f"), _num(CPU_TARGETS_US.get(key), "g"))
    if "producer_submit" in cpu:
        table.add_row(
            "producer submit + gather", f"{cpu['producer_submit'] + cpu['producer_gather']:.1f}", "40"
        )
        total = sum(cpu[k] for k in ("producer_submit", "producer_gather", "redis", "coordinator", "worker"))
        table.add_row("[bold]all[/bold]", f"[bold]{total:.1f}[/bold]", "")
    console.print(table)

    over = report.get("cpu_over_run")
    if over:
        table = Table(
            title=f"Cores busy during the burst (of {over['machine_cores']}; per {over['bucket_s']} s bucket)"
        )
        table.add_column("")
        table.add_column("buckets", justify="right")
        table.add_column("all", justify="right")
        names = list(over["whole_run"]["cores"])
        for name in names:
            table.add_column(name, justify="right")
        rows = (
            ("whole run", over["whole_run"]),
            ("device waiting (busy < 0.5)", over["device_waiting"]),
            ("device saturated (busy >= 0.9)", over["device_saturated"]),
        )
        for label, part in rows:
            table.add_row(
                label,
                _num(part.get("buckets"), "d") if "buckets" in part else "-",
                _num(part.get("total_cores"), ".2f"),
                *(_num(part.get("cores", {}).get(name), ".2f") for name in names),
            )
        console.print(table)

    pipeline = report.get("pipeline") or {}
    light = report.get("light") or {}
    table = Table(title="Pipeline (null model) and light load")
    table.add_column("")
    table.add_column("value", justify="right")
    p_carpool, noop = pipeline.get("carpool") or {}, pipeline.get("celery_noop") or {}
    table.add_row(
        f"carpool, {_num(p_carpool.get('requests'), 'd')} requests via submit_many + gather",
        f"{_num(p_carpool.get('throughput_rps'), ',.0f')} req/s",
    )
    table.add_row(
        f"plain Celery no-op, {_num(noop.get('tasks'), 'd')} x .delay() then .get()",
        f"{_num(noop.get('throughput_rps'), ',.0f')} tasks/s",
    )
    table.add_row("[bold]ratio[/bold]", f"[bold]{_num(pipeline.get('ratio'), '.1f')}[/bold]")
    p_cpu = p_carpool.get("cpu_us_per_request") or {}
    if p_cpu:
        table.add_row(
            "carpool null CPU µs/request",
            ", ".join(
                f"{k} {p_cpu[k]:.0f}"
                for k in ("producer_submit", "producer_gather", "redis", "coordinator", "worker")
                if k in p_cpu
            ),
        )
    latency = light.get("latency_ms") or {}
    table.add_row(
        f"lone short request, null model ({_num(light.get('requests'), 'd')}x): p50 / p99",
        f"{_num(latency.get('p50'), '.2f')} / {_num(latency.get('p99'), '.2f')} ms",
    )
    console.print(table)

    table = Table(title="Targets")
    for column in ("target", "measured", "goal", "state"):
        table.add_column(column, justify="left" if column == "target" else "right")
    for t in report["targets"]:
        state = {True: "[green]MET[/green]", False: "[red]NOT MET[/red]", None: "not measured"}[t["met"]]
        table.add_row(t["name"], _num(t["measured"], ".3g"), f"{t['target']:g}", state)
    console.print(table)
    machine = report["machine"]
    console.print(
        f"load average at start {machine.get('load_average')}, at end {machine.get('load_average_end')}; "
        f"other processes kept {_num(carpool.get('background_cpu_cores'), '.2f')} cores busy during the run"
    )
    for err in report["errors"]:
        console.print(f"[red]error[/red]: {err['phase']}: {err['error']}")

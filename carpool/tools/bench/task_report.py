"""The report of ``carpool bench --task``: its schema, the comparison between systems, rich tables.

Schema ``carpool-bench-task/1``::

    {
      "schema", "created_at", "command", "machine",
      "task": {"given", "name", "module", "max_batch", "max_tokens", "bins"},
      "config": {"requests", "seed", "max_batch", "max_wait_s", "workers", "systems", "rates", "quick",
                 "torch_threads", "model_dir", "send_chunk", "deadline_s", "elapsed_s"},
      "workload": {"source", "requests", "lengths": {"min", "p50", "mean", "p90", "p99", "max"}},
      "runs": [RunRecord],                      # a burst per system, then one run per offered rate
      "comparison": {"burst_rps": {system: float}, "carpool_vs_celery_batches": float | null,
                     "carpool_vs_celery": float | null, "reference": str | null,
                     "outputs_agree": {system: bool}},
      "samples": {"items": [item], "outputs": {system: [output | {"error": str}]},
                  "tolerance": {"rel", "abs"}},
      "errors": [{"system", "phase", "error"}]
    }

RunRecord as in :mod:`carpool.tools.bench.report`; ``padding_ratio`` is padded / real lengths, from the
task's own ``length``. ``outputs_agree``: each system's outputs for the first items against the
reference system's (carpool when it ran), numbers within ``tolerance`` (batches padded differently
may round differently).
"""

from __future__ import annotations

import math
from typing import Any

from carpool.tools.bench.report import top_level_problems

SCHEMA = "carpool-bench-task/1"
TOLERANCE = {"rel": 1e-4, "abs": 1e-5}

_RUN_KEYS = ("system", "mode", "requests", "completed", "failed", "throughput_rps", "latency_ms")


def outputs_agree(a: Any, b: Any, rel: float = TOLERANCE["rel"], abs_: float = TOLERANCE["abs"]) -> bool:
    """Whether two outputs are equal, numbers (not booleans) within ``rel`` / ``abs_``, recursively."""
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(a, b, rel_tol=rel, abs_tol=abs_)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(outputs_agree(x, y, rel, abs_) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(outputs_agree(a[k], b[k], rel, abs_) for k in a)
    return bool(a == b)


def _burst(runs: list[dict[str, Any]], system: str) -> dict[str, Any] | None:
    return next((r for r in runs if r["system"] == system and r["mode"] == "burst"), None)


def _ratio(runs: list[dict[str, Any]], a: str, b: str) -> float | None:
    first, second = _burst(runs, a), _burst(runs, b)
    if not first or not second or not second["throughput_rps"]:
        return None
    return float(first["throughput_rps"] / second["throughput_rps"])


def compare(runs: list[dict[str, Any]], outputs: dict[str, list[Any]]) -> dict[str, Any]:
    """Burst throughput per system, carpool's ratios to the two baselines, and whether the systems'
    sampled outputs agree with the reference's."""
    reference = "carpool" if "carpool" in outputs else next(iter(outputs), None)
    agree = {}
    if reference is not None:
        expected = outputs[reference]
        for system, got in outputs.items():
            if system != reference:
                agree[system] = outputs_agree(got, expected)
    return {
        "burst_rps": {r["system"]: r["throughput_rps"] for r in runs if r["mode"] == "burst"},
        "carpool_vs_celery_batches": _ratio(runs, "carpool", "celery-batches"),
        "carpool_vs_celery": _ratio(runs, "carpool", "celery"),
        "reference": reference,
        "outputs_agree": agree,
    }


def validate_report(report: Any) -> list[str]:
    """Problems with ``report`` against schema carpool-bench-task/1 (empty when well-formed)."""
    problems, complete = top_level_problems(
        report,
        SCHEMA,
        (
            ("schema", str),
            ("created_at", str),
            ("machine", dict),
            ("task", dict),
            ("config", dict),
            ("workload", dict),
            ("runs", list),
            ("comparison", dict),
            ("samples", dict),
            ("errors", list),
        ),
    )
    if not complete:
        return problems
    if not isinstance(report["task"].get("name"), str):
        problems.append("task.name missing")
    if not isinstance(report["workload"].get("lengths"), dict):
        problems.append("workload.lengths missing")
    for i, run in enumerate(report["runs"]):
        missing = [k for k in _RUN_KEYS if k not in run]
        if missing:
            problems.append(f"run {i}: {', '.join(missing)} missing")
        elif run["completed"] + run["failed"] != run["requests"]:
            problems.append(f"run {i}: completed + failed != requests")
    for key in ("burst_rps", "outputs_agree"):
        if not isinstance(report["comparison"].get(key), dict):
            problems.append(f"comparison.{key} missing")
    if not isinstance(report["samples"].get("outputs"), dict):
        problems.append("samples.outputs missing")
    return problems


def _num(value: Any, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def print_report(report: dict[str, Any], console: Any = None) -> None:
    """The report as a rich table on ``console`` (stdout by default)."""
    from rich import box
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    task, config, workload = report["task"], report["config"], report["workload"]
    lengths = workload["lengths"]
    console.print(
        f"[bold]carpool bench --task {escape(task['given'])}[/bold] ({escape(task['name'])}): "
        f"{workload['requests']} items, {escape(workload['source'])}; lengths p50 "
        f"{_num(lengths.get('p50'), '.0f')}, max {_num(lengths.get('max'), '.0f')}; "
        f"max batch {task['max_batch']}, max wait {config['max_wait_s']:g} s"
    )
    table = Table(
        title="Per system (batches: count x mean size; padding: padded / real lengths)",
        box=box.SIMPLE_HEAD,
        show_edge=False,
    )
    table.add_column("system", no_wrap=True)
    table.add_column("run", no_wrap=True)
    for column in ("done/s", "p50 / p99 ms", "batches", "padding", "failed"):
        table.add_column(column, justify="right", no_wrap=True)
    for run in report["runs"]:
        batches = run.get("batches") or {}
        offered = run.get("offered_rps")
        failed = run["failed"]
        table.add_row(
            run["system"],
            run["mode"] if offered is None else f"{offered:g}/s",
            _num(run["throughput_rps"]),
            f"{run['latency_ms']['p50']:.0f} / {run['latency_ms']['p99']:.0f}",
            f"{batches['count']} x {batches['mean_size']:.1f}" if batches else "-",
            _num(run.get("padding_ratio"), ".2f"),
            f"[red]{failed}[/red]" if failed else "0",
        )
    console.print(table)
    comparison = report["comparison"]
    console.print(
        "burst throughput, carpool / celery-batches: "
        f"[bold]{_num(comparison.get('carpool_vs_celery_batches'), '.2f')}[/bold]; "
        f"carpool / plain Celery: [bold]{_num(comparison.get('carpool_vs_celery'), '.2f')}[/bold]"
    )
    agree = comparison.get("outputs_agree") or {}
    if agree:
        states = ", ".join(f"{s} {'agrees' if ok else '[red]DIFFERS[/red]'}" for s, ok in agree.items())
        count = len(report["samples"]["items"])
        console.print(f"outputs of the first {count} items, against {comparison['reference']}: {states}")
    for err in report["errors"]:
        console.print(f"[red]error[/red]: {err['system']} {err['phase']}: {escape(str(err['error']))}")

"""The JSON report of ``carpool bench``: its schema, the targets it is judged against, a text summary.

Schema ``carpool-bench/1`` (every run, whatever its system, is one :class:`RunRecord` dict)::

    {
      "schema": "carpool-bench/1", "created_at": ISO-8601, "command": str,
      "machine": {"cpus": int, "platform": str, "python": str, "packages": {name: version}, ...},
      "model": str,
      "config": {"requests": int, "seed": int, "max_batch": int, "max_wait_s": float, "workers": int,
                 "systems": [str], "rates": [str], "quick": bool, "deadline_s": float},
      "workload": {"requests": int, "seed": int, "length_distribution": str,
                   "token_lengths": {"min", "p50", "mean", "p90", "p99", "max"}},
      "runs": [RunRecord],                       # offline, bursts, rates, light, per system
      "pipeline": null | {"model": "null", "requests": int, "runs": [RunRecord]},
      "sweep": null | {"rate_rps": float, "points": [{"max_batch", "max_wait_s", "runs": [RunRecord]}]},
      "targets": [{"name", "description", "target", "measured", "met": bool | null}],
      "plots": [file name], "errors": [{"system", "phase", "error"}]
    }

RunRecord: ``system``, ``mode`` (burst | rate | light), ``requests``, ``completed``, ``failed``,
``wall_s``, ``throughput_rps``, ``latency_ms`` {p50, p90, p99, mean, max}, ``offered_rps`` (rate runs),
``half_saturation`` (the rate run at half the system's burst throughput), ``batches``
{count, mean_size, sizes {size: count}} or null, ``padding_ratio`` (padded / real tokens) or null,
``extra`` {...}.
"""

from __future__ import annotations

import os
import platform
import sys
from datetime import UTC, datetime
from typing import Any

SCHEMA = "carpool-bench/1"
PLAIN_CELERY_NOOP_REFERENCE_RPS = 670.0  # plain Celery's no-op rate measured on the 2-core reference machine

_RUN_KEYS: dict[str, type | tuple[type, ...]] = {
    "system": str,
    "mode": str,
    "requests": int,
    "completed": int,
    "failed": int,
    "wall_s": (int, float),
    "throughput_rps": (int, float),
    "latency_ms": dict,
    "half_saturation": bool,
    "extra": dict,
}
_LATENCY_KEYS = ("p50", "p90", "p99", "mean", "max")


def machine_info() -> dict[str, Any]:
    from importlib import metadata

    packages = {}
    for name in (
        "celery",
        "kombu",
        "redis",
        "celery-batches",
        "torch",
        "transformers",
        "tokenizers",
        "numpy",
    ):
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        affinity = os.cpu_count() or 0
    return {
        "cpus": os.cpu_count() or 0,
        "cpus_usable": affinity,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": sys.version.split()[0],
        "packages": packages,
        "load_average": _loadavg(),
        **_model_placement(),
    }


def _model_placement() -> dict[str, Any]:
    """Where this environment's settings put a worker's models (``CARPOOL_DEVICE``, as set, and
    ``CARPOOL_AUTOCAST_BF16``), and the GPU's name where torch, already imported, sees one."""
    from carpool.config import load_settings

    settings = load_settings()
    torch = sys.modules.get("torch")
    gpu = torch.cuda.get_device_name(0) if torch is not None and torch.cuda.is_available() else None
    return {"carpool_device": settings.device, "autocast_bf16": settings.autocast_bf16, "gpu": gpu}


def _loadavg() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except OSError:
        return None


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def find_run(
    runs: list[dict[str, Any]], system: str, mode: str, half: bool | None = None
) -> dict[str, Any] | None:
    for run in runs:
        if (
            run["system"] == system
            and run["mode"] == mode
            and (half is None or run.get("half_saturation") == half)
        ):
            return run
    return None


def _ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    if not a or not b or not b["throughput_rps"]:
        return None
    return float(a["throughput_rps"] / b["throughput_rps"])


def _service_rps(run: dict[str, Any] | None) -> float | None:
    if not run:
        return None
    value = run["extra"].get("service_rps")
    return float(value) if value else None


def _service_ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> float | None:
    num, den = _service_rps(a), _service_rps(b)
    return num / den if num and den else None


def evaluate_targets(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, each with what this run measured (null when the run did not measure it)."""
    runs = report["runs"]
    burst = {s: find_run(runs, s, "burst") for s in ("offline", "carpool", "celery", "celery-batches")}
    half = find_run(runs, "carpool", "rate", half=True)
    light = find_run(runs, "carpool", "light")
    deadline_s = float(report["config"].get("deadline_s") or 60.0)
    targets: list[dict[str, Any]] = []

    def add(
        name: str, description: str, target: float, measured: float | None, higher_is_better: bool
    ) -> None:
        met = None if measured is None else (measured >= target if higher_is_better else measured <= target)
        targets.append(
            {"name": name, "description": description, "target": target, "measured": measured, "met": met}
        )

    add(
        "burst_vs_offline",
        "burst end-to-end throughput, carpool / offline limit",
        0.9,
        _ratio(burst["carpool"], burst["offline"]),
        True,
    )
    add(
        "burst_vs_celery_batches",
        "burst throughput, carpool / celery-batches",
        2.5,
        _ratio(burst["carpool"], burst["celery-batches"]),
        True,
    )
    add(
        "burst_vs_plain_celery",
        "burst throughput, carpool / plain Celery",
        1.3,
        _ratio(burst["carpool"], burst["celery"]),
        True,
    )
    add(
        "half_saturation_p99_s",
        f"p99 latency (s) at half of carpool's burst throughput, within the deadline ({deadline_s:g}s)",
        deadline_s,
        half["latency_ms"]["p99"] / 1000 if half else None,
        False,
    )
    pipeline = report.get("pipeline") or {}
    p_runs = pipeline.get("runs") or []
    p_carpool = find_run(p_runs, "carpool", "burst")
    p_plain = find_run(p_runs, "celery", "burst")
    add(
        "null_pipeline_vs_plain_celery",
        "null model: carpool burst rate / plain Celery no-op rate, end to end (producer included)",
        10.0,
        _ratio(p_carpool, p_plain),
        True,
    )
    add(
        "null_service_vs_plain_celery",
        "null model: the same, counted from when the pipelined publish returned (service only)",
        10.0,
        _service_ratio(p_carpool, p_plain),
        True,
    )
    add(
        "null_pipeline_rps",
        f"null model: carpool service rate (req/s), vs 10x the "
        f"{PLAIN_CELERY_NOOP_REFERENCE_RPS:g}/s plain-Celery reference",
        10 * PLAIN_CELERY_NOOP_REFERENCE_RPS,
        _service_rps(p_carpool),
        True,
    )
    add(
        "light_overhead_p50_ms",
        "one short request at a time: p50 latency over the model's own time (ms)",
        20.0,
        light["extra"].get("overhead_p50_ms") if light else None,
        False,
    )
    return targets


def top_level_problems(
    report: Any, schema: str, fields: tuple[tuple[str, type], ...]
) -> tuple[list[str], bool]:
    """What is wrong with a report's top level (not an object, a field missing or of the wrong type,
    another schema), and whether its fields are all there for deeper checks. Every bench report's
    validator starts here."""
    if not isinstance(report, dict):
        return ["report is not an object"], False
    problems = [
        f"{key}: missing or not a {kind.__name__}"
        for key, kind in fields
        if not isinstance(report.get(key), kind)
    ]
    if problems:
        return problems, False
    if report["schema"] != schema:
        problems.append(f"schema is {report['schema']!r}, expected {schema!r}")
    return problems, True


def validate_report(report: Any) -> list[str]:
    """Problems with ``report`` against schema carpool-bench/1 (empty when well-formed)."""
    problems, complete = top_level_problems(
        report,
        SCHEMA,
        (
            ("schema", str),
            ("created_at", str),
            ("command", str),
            ("machine", dict),
            ("model", str),
            ("config", dict),
            ("workload", dict),
            ("runs", list),
            ("targets", list),
            ("plots", list),
            ("errors", list),
        ),
    )
    if not complete:
        return problems
    if not isinstance(report["machine"].get("cpus"), int):
        problems.append("machine.cpus missing")
    wl = report["workload"]
    if not isinstance(wl.get("length_distribution"), str) or not isinstance(wl.get("token_lengths"), dict):
        problems.append("workload: length_distribution / token_lengths missing")
    all_runs = list(report["runs"])
    if report.get("pipeline") is not None:
        all_runs += report["pipeline"].get("runs", [])
    for point in (report.get("sweep") or {}).get("points", []):
        for key in ("max_batch", "max_wait_s", "runs"):
            if key not in point:
                problems.append(f"sweep point without {key}")
        all_runs += point.get("runs", [])
    for i, run in enumerate(all_runs):
        problems.extend(f"run {i}: {p}" for p in _validate_run(run))
    for t in report["targets"]:
        if not {"name", "target", "measured", "met"} <= set(t):
            problems.append(f"target {t.get('name')!r} incomplete")
    return problems


def _validate_run(run: Any) -> list[str]:
    if not isinstance(run, dict):
        return ["not an object"]
    out = []
    for key, kind in _RUN_KEYS.items():
        if not isinstance(run.get(key), kind):
            out.append(f"{key} missing or wrong type")
    if out:
        return out
    if run["mode"] not in ("burst", "rate", "light"):
        out.append(f"mode {run['mode']!r}")
    if run["mode"] == "rate" and not isinstance(run.get("offered_rps"), int | float):
        out.append("rate run without offered_rps")
    if run["completed"] + run["failed"] != run["requests"]:
        out.append("completed + failed != requests")
    if any(not isinstance(run["latency_ms"].get(k), int | float) for k in _LATENCY_KEYS):
        out.append("latency_ms incomplete")
    batches = run.get("batches")
    if batches is not None and not (
        isinstance(batches.get("sizes"), dict) and isinstance(batches.get("count"), int)
    ):
        out.append("batches malformed")
    if run.get("padding_ratio") is not None and not isinstance(run["padding_ratio"], int | float):
        out.append("padding_ratio not a number")
    return out


def summary_text(report: dict[str, Any]) -> str:
    """A plain-text table of the runs and targets, for the terminal."""
    lines = [
        f"carpool bench: model {report['model']}, {report['workload']['requests']} requests "
        f"({report['workload']['length_distribution']})"
    ]
    header = (
        f"{'system':<15}{'mode':<7}{'offered/s':>10}{'thru/s':>10}{'p50 ms':>10}{'p99 ms':>10}"
        f"{'batch':>7}{'pad':>6}{'fail':>6}{'bg':>6}"
    )
    lines.append(header)
    runs = list(report["runs"]) + list((report.get("pipeline") or {}).get("runs") or [])
    for run in runs:
        offered = "" if run.get("offered_rps") is None else f"{run['offered_rps']:.0f}"
        if run.get("half_saturation"):
            offered += "*"
        mean = run["batches"]["mean_size"] if run.get("batches") else None
        pad = run.get("padding_ratio")
        bg = run["extra"].get("background_cpu_cores")
        name = run["system"] + (" (null)" if run in (report.get("pipeline") or {}).get("runs", []) else "")
        lines.append(
            f"{name:<15}{run['mode']:<7}{offered:>10}{run['throughput_rps']:>10.1f}{run['latency_ms']['p50']:>10.1f}"
            f"{run['latency_ms']['p99']:>10.1f}{'' if mean is None else f'{mean:.1f}':>7}"
            f"{'' if pad is None else f'{pad:.2f}':>6}{run['failed']:>6}"
            f"{'' if bg is None else f'{bg:.2f}':>6}"
        )
    lines.append(
        "(* = half of the system's own burst throughput; bg = CPU cores busy with other work during the run)"
    )
    for run in (report.get("pipeline") or {}).get("runs") or []:
        svc = run["extra"].get("service_rps")
        cpu = run["extra"].get("cpu_ms_per_request") or {}
        lines.append(
            f"pipeline (null model) {run['system']}: {run['throughput_rps']:.0f}/s end to end, "
            f"{'-' if svc is None else f'{svc:.0f}'}/s after the publish; CPU ms/request "
            + ", ".join(f"{k} {v:.3f}" for k, v in cpu.items())
        )
    for point in (report.get("sweep") or {}).get("points", []):
        for run in point["runs"]:
            lines.append(
                f"sweep max_batch={point['max_batch']:<4} max_wait={point['max_wait_s']:<6} {run['mode']:<6}"
                f" thru {run['throughput_rps']:8.1f}/s p50 {run['latency_ms']['p50']:8.1f} ms"
                f" p99 {run['latency_ms']['p99']:8.1f} ms"
            )
    lines.append("targets:")
    for t in report["targets"]:
        state = {True: "MET", False: "NOT MET", None: "not measured"}[t["met"]]
        measured = "-" if t["measured"] is None else f"{t['measured']:.3g}"
        lines.append(f"  {t['name']:<32} measured {measured:>8}  target {t['target']:g}  {state}")
    for err in report["errors"]:
        lines.append(f"error: {err['system']} {err['phase']}: {err['error']}")
    return "\n".join(lines)

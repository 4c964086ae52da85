"""One ``carpool bench`` invocation, in order: offline first, then each system (burst, half
saturation, each offered rate, light load), the null-model pipeline, or the max batch x max wait sweep;
then targets, plots and ``report.json``. A failing system is recorded in the report and skipped."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from carpool.tools.bench.env import BenchEnv
from carpool.tools.bench.measure import SHORT_TEXT, length_stats, parse_rates
from carpool.tools.bench.report import SCHEMA, evaluate_targets, machine_info, now_iso, validate_report
from carpool.tools.bench.systems import POLICY_SYSTEMS, SYSTEMS, make_system
from carpool.tools.bench.systems.base import SEND_CHUNK

# Counts of a full run, and of ``--quick``; an option given on the command line wins over both.
FULL = {
    "requests": 600,
    "rates": "0.25x,0.5x,0.75x,1x,1.5x",
    "light": 20,
    "pipeline": 4000,
    "sweep_batches": "8,32,128",
    "sweep_waits": "0.005,0.05,0.2",
    "max_batch": 32,
    "max_wait": 0.05,
}
QUICK = {
    "requests": 40,
    "rates": "0.5x,1x",
    "light": 3,
    "pipeline": 200,
    "sweep_batches": "8,32",
    "sweep_waits": "0.005,0.05",
    "max_batch": 32,
    "max_wait": 0.05,
}


def option(args: argparse.Namespace, name: str) -> Any:
    """``args.<name>`` when given, else the full or quick default."""
    value = getattr(args, name, None)
    return value if value is not None else (QUICK if args.quick else FULL)[name]


def run_bench(args: argparse.Namespace) -> tuple[dict[str, Any], Path]:
    from carpool.models import get_model
    from carpool.tools.bench.offline import offline
    from carpool.tools.bench.plots import write_plots
    from carpool.tools.workload import describe, mixed_texts

    # Every later step reads the batching options from ``args``: resolve their defaults once.
    args.max_batch = int(option(args, "max_batch"))
    args.max_wait = float(option(args, "max_wait"))
    systems = [s.strip() for s in (args.systems or ",".join(SYSTEMS)).split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS) - set(POLICY_SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {', '.join(sorted(unknown))}; choose from {', '.join(SYSTEMS)}")
    n = int(option(args, "requests"))
    if n < 2:
        raise ValueError("--requests must be at least 2")
    rate_spec = str(option(args, "rates"))
    rates = [] if rate_spec.strip().lower() == "none" else parse_rates(rate_spec)
    light = int(option(args, "light"))
    pipeline_n = 0 if args.sweep else int(option(args, "pipeline"))
    if pipeline_n and not {"carpool", "celery"} & set(systems):
        pipeline_n = 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    texts = mixed_texts(n, args.seed)
    lengths = [len(ids) for ids in get_model(args.model).encode(texts)]
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "created_at": now_iso(),
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "machine": machine_info(),
        "model": args.model,
        "config": {
            "requests": n,
            "seed": args.seed,
            "max_batch": args.max_batch,
            "max_wait_s": args.max_wait,
            "workers": args.workers,
            "systems": systems,
            "rates": [f"{v:g}{'x' if rel else ''}" for v, rel in rates],
            "quick": bool(args.quick),
            "torch_threads": int(getattr(args, "torch_threads", 0) or 0),
            "light": light,
            "sweep": bool(args.sweep),
            "send_chunk": SEND_CHUNK,  # messages per MULTI/EXEC when a burst is sent, every system
            "redis": getattr(args, "redis", "tcp"),
        },
        "workload": {
            "requests": n,
            "seed": args.seed,
            "length_distribution": describe() + " (word counts)",
            "token_lengths": length_stats(lengths),
        },
        "runs": [],
        "pipeline": None,
        "sweep": None,
        "targets": [],
        "plots": [],
        "errors": [],
    }
    runs: list[dict[str, Any]] = report["runs"]
    extra_models = ("null",) if pipeline_n else ()
    profile = bool(getattr(args, "profile", False))
    env_ = BenchEnv(
        out,
        args.model,
        args.max_batch,
        args.max_wait,
        args.workers,
        extra_models,
        profile=profile,
        unix_socket=getattr(args, "redis", "tcp") == "unix",
    )
    with env_ as env:
        report["config"]["deadline_s"] = env.settings.default_deadline_s
        started = time.monotonic()
        off = offline(args.model, texts, args.max_batch)
        if "offline" in systems:
            runs.append(off.to_dict())
        _log(f"offline: {off.throughput_rps:.1f} req/s")
        resolved = sorted({round(v * off.throughput_rps if rel else v, 3) for v, rel in rates})
        model_ms = None
        if light and not args.sweep:
            from carpool.tools.bench.offline import model_time_ms

            model_ms = model_time_ms(args.model, SHORT_TEXT)
            report["config"]["model_ms_short_text"] = model_ms
        if args.sweep:
            report["sweep"] = _sweep(env, args, texts, lengths, off.throughput_rps, report)
        else:
            for name in systems:
                if name == "offline":
                    continue
                _run_system(env, name, args, texts, lengths, resolved, light, model_ms, report)
            if pipeline_n:
                report["pipeline"] = _pipeline(env, args, pipeline_n, systems, report)
        report["config"]["elapsed_s"] = round(time.monotonic() - started, 1)
        env.stop_all()
        if profile:
            report["config"]["profiles"] = sorted(env.summarize_profiles())
    report["targets"] = evaluate_targets(report)
    try:
        report["plots"] = write_plots(report, out)
    except Exception as exc:  # a plot failure must not lose the numbers
        report["errors"].append({"system": "-", "phase": "plots", "error": repr(exc)})
    problems = validate_report(report)
    if problems:
        report["errors"].append({"system": "-", "phase": "schema", "error": "; ".join(problems)})
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report, out


def _log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _error(report: dict[str, Any], system: str, phase: str, exc: BaseException) -> None:
    _log(f"{system} {phase} failed: {exc!r}")
    report["errors"].append(
        {"system": system, "phase": phase, "error": repr(exc), "traceback": traceback.format_exc(limit=8)}
    )


def _run_system(
    env: Any,
    name: str,
    args: argparse.Namespace,
    texts: list[str],
    lengths: list[int],
    rates: list[float],
    light: int,
    model_ms: float | None,
    report: dict[str, Any],
) -> None:
    runs = report["runs"]
    system = make_system(env, name, args.model, args.max_batch, args.max_wait, args.timeout)
    phase = "start"
    try:
        _log(f"{name}: starting")
        system.start()
        phase = "burst"
        burst = system.burst(texts, lengths)
        runs.append(burst.to_dict())
        _log(f"{name}: burst {burst.throughput_rps:.1f} req/s, p99 {burst.latency_ms['p99']:.0f} ms")
        if rates:
            phase = "half-saturation"
            half = system.rate(texts, lengths, 0.5 * burst.throughput_rps, args.seed + 1)
            half.half_saturation = True
            runs.append(half.to_dict())
        for i, rate in enumerate(rates):
            phase = f"rate {rate:g}"
            rec = system.rate(texts, lengths, rate, args.seed + 2 + i)
            runs.append(rec.to_dict())
            _log(
                f"{name}: offered {rate:.1f}/s -> {rec.throughput_rps:.1f}/s, "
                f"p50 {rec.latency_ms['p50']:.0f} ms, p99 {rec.latency_ms['p99']:.0f} ms"
            )
        if light:
            phase = "light"
            rec = system.light(SHORT_TEXT, light, model_ms)
            runs.append(rec.to_dict())
            _log(f"{name}: light p50 {rec.latency_ms['p50']:.1f} ms (model {model_ms or 0:.1f} ms)")
    except Exception as exc:
        _error(report, name, phase, exc)
    finally:
        system.stop()
        env.flush()


def _pipeline(
    env: Any, args: argparse.Namespace, count: int, systems: list[str], report: dict[str, Any]
) -> dict[str, Any]:
    """Null model: what the pipeline itself costs per request, carpool against plain Celery."""
    from carpool.models import get_model
    from carpool.tools.bench.systems.baseline_workers import PlainCelerySystem
    from carpool.tools.bench.systems.carpool import CarpoolSystem
    from carpool.tools.workload import mixed_texts

    texts = mixed_texts(count, args.seed + 7)
    lengths = [len(ids) for ids in get_model("null").encode(texts)]
    result: dict[str, Any] = {"model": "null", "requests": count, "runs": []}
    overrides = {"CARPOOL_MODEL": "null", "CARPOOL_MODELS": "null"}
    env_model = env.model
    for name in ("carpool", "celery"):
        if name not in systems:
            continue
        system: Any
        if name == "carpool":
            system = CarpoolSystem(env, args.timeout, extra_env=overrides)
        else:
            system = PlainCelerySystem(env, args.timeout)
        env.model = "null"  # child processes serve the null model
        system.model = "null"
        try:
            system.start()
            rec = system.burst(texts, lengths)
            rec.extra["model"] = "null"
            result["runs"].append(rec.to_dict())
            _log(f"pipeline {name}: {rec.throughput_rps:.0f} req/s")
        except Exception as exc:
            _error(report, name, "pipeline", exc)
        finally:
            system.stop()
            env.model = env_model
            env.flush()
    return result


def _sweep(
    env: Any,
    args: argparse.Namespace,
    texts: list[str],
    lengths: list[int],
    offline_rps: float,
    report: dict[str, Any],
) -> dict[str, Any]:
    from carpool.tools.bench.systems.carpool import CarpoolSystem

    batches = [int(v) for v in str(option(args, "sweep_batches")).split(",") if v.strip()]
    waits = [float(v) for v in str(option(args, "sweep_waits")).split(",") if v.strip()]
    (value, relative), *_ = parse_rates(args.sweep_rate)
    rate = value * offline_rps if relative else value
    result: dict[str, Any] = {"rate_rps": rate, "points": []}
    system = CarpoolSystem(env, args.timeout)
    try:
        system.start()
        for mb in batches:
            for mw in waits:
                point: dict[str, Any] = {"max_batch": mb, "max_wait_s": mw, "runs": []}
                try:
                    system.restart_coordinator(CARPOOL_MAX_BATCH=str(mb), CARPOOL_MAX_WAIT_S=str(mw))
                    for rec in (
                        system.burst(texts, lengths),
                        system.rate(texts, lengths, rate, args.seed + 1),
                    ):
                        rec.extra.update(max_batch=mb, max_wait_s=mw)
                        point["runs"].append(rec.to_dict())
                    _log(
                        f"sweep max_batch={mb} max_wait={mw}: "
                        f"burst {point['runs'][0]['throughput_rps']:.0f}/s, "
                        f"p99 at {rate:.0f}/s {point['runs'][1]['latency_ms']['p99']:.0f} ms"
                    )
                except Exception as exc:
                    _error(report, "carpool", f"sweep {mb}/{mw}", exc)
                result["points"].append(point)
    except Exception as exc:
        _error(report, "carpool", "sweep start", exc)
    finally:
        system.stop()
        env.flush()
    return result

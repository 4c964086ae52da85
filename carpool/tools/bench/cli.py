"""``carpool bench`` / ``python -m carpool.tools.bench``: options, the order of runs, report and plots.

    carpool bench                                    # minilm, every system, rates up to 1.5x offline
    carpool bench --model toy --quick --out /tmp/b   # a small, fast run
    carpool bench --sweep                            # carpool over max batch x max wait

Per system: start it (processes up, model loaded, warmed), a burst of every request at once, an
open-loop Poisson run at half the system's own burst throughput, one run per offered rate, then
``--light`` single short requests one at a time. Then, with ``--pipeline N``, a burst of N requests
through carpool and through plain Celery with the ``null`` model (no compute: the pipeline's own cost).
Rates ending in ``x`` are multiples of the offline limit measured first in the same invocation.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from carpool.tools.bench.measure import SHORT_TEXT, length_stats, parse_rates
from carpool.tools.bench.report import (
    SCHEMA,
    evaluate_targets,
    machine_info,
    now_iso,
    summary_text,
    validate_report,
)
from carpool.tools.bench.runners import POLICY_SYSTEMS, SEND_CHUNK, SYSTEMS

FULL = {
    "requests": 600,
    "rates": "0.25x,0.5x,0.75x,1x,1.5x",
    "light": 20,
    "pipeline": 4000,
    "sweep_batches": "8,32,128",
    "sweep_waits": "0.005,0.05,0.2",
}
QUICK = {
    "requests": 40,
    "rates": "0.5x,1x",
    "light": 3,
    "pipeline": 200,
    "sweep_batches": "8,32",
    "sweep_waits": "0.005,0.05",
}


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--model",
        default="minilm",
        help="model for every system: minilm (default), toy, null, or package.module:Class",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"requests per run (default {FULL['requests']}, --quick {QUICK['requests']})",
    )
    parser.add_argument(
        "--rates",
        default=None,
        help="offered rates, comma separated: requests/s, or multiples of "
        f"the offline limit with an x suffix (default {FULL['rates']}); none = bursts only",
    )
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma separated, from {', '.join(SYSTEMS + POLICY_SYSTEMS)} (default: {', '.join(SYSTEMS)})",
    )
    parser.add_argument("--out", default="bench-out", help="directory for report.json, plots and logs")
    parser.add_argument("--quick", action="store_true", help="tiny counts for a fast smoke run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch", type=int, default=32, help="max batch of every batching system")
    parser.add_argument("--max-wait", type=float, default=0.05, help="max wait (s) of every batching system")
    parser.add_argument("--workers", type=int, default=1, help="carpool GPU-worker processes")
    parser.add_argument(
        "--light",
        type=int,
        default=None,
        help=f"single short requests, one at a time (default {FULL['light']}; 0 skips)",
    )
    parser.add_argument(
        "--pipeline",
        type=int,
        default=None,
        metavar="N",
        help=f"null-model burst of N through carpool and plain Celery (default {FULL['pipeline']}; 0 skips)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="instead of the comparison: carpool over "
        "--sweep-batches x --sweep-waits, burst and one offered rate each",
    )
    parser.add_argument(
        "--sweep-batches", default=None, help=f"max batch values (default {FULL['sweep_batches']})"
    )
    parser.add_argument(
        "--sweep-waits", default=None, help=f"max wait values, s (default {FULL['sweep_waits']})"
    )
    parser.add_argument(
        "--sweep-rate", default="0.7x", help="offered rate of the sweep's rate runs (default 0.7x)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run the carpool and Celery processes under cProfile: OUT/profiles/<process>.prof and .txt",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch CPU threads in every system (CARPOOL_TORCH_THREADS; 0 = torch's default)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="longest wait for one run's results (s)")
    return parser


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench",
        help="benchmark carpool against offline, Celery and celery-batches",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure(parser)
    parser.set_defaults(func=run_cli)
    return parser


def build_parser() -> argparse.ArgumentParser:
    return configure(
        argparse.ArgumentParser(
            prog="carpool bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(build_parser().parse_args(argv))


def run_cli(args: argparse.Namespace) -> int:
    from carpool.errors import ConfigError

    try:
        report, out = run_bench(args)
    except (ConfigError, ValueError) as exc:
        print(f"carpool bench: {exc}", file=sys.stderr)
        return 2
    print(summary_text(report))
    print(f"report: {out / 'report.json'}; plots: {', '.join(report['plots']) or 'none'}")
    return 1 if report["errors"] else 0


def _opt(args: argparse.Namespace, name: str) -> Any:
    value = getattr(args, name, None)
    return value if value is not None else (QUICK if args.quick else FULL)[name]


def run_bench(args: argparse.Namespace) -> tuple[dict[str, Any], Path]:
    from carpool.models import get_model
    from carpool.tools.bench.plots import write_plots
    from carpool.tools.bench.runners import BenchEnv, offline
    from carpool.tools.workload import describe, mixed_texts

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS) - set(POLICY_SYSTEMS)
    if unknown:
        raise ValueError(f"unknown systems {', '.join(sorted(unknown))}; choose from {', '.join(SYSTEMS)}")
    n = int(_opt(args, "requests"))
    if n < 2:
        raise ValueError("--requests must be at least 2")
    rate_spec = str(_opt(args, "rates"))
    rates = [] if rate_spec.strip().lower() == "none" else parse_rates(rate_spec)
    light = int(_opt(args, "light"))
    pipeline_n = 0 if args.sweep else int(_opt(args, "pipeline"))
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
        out, args.model, args.max_batch, args.max_wait, args.workers, extra_models, profile=profile
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
            from carpool.tools.bench.runners import model_time_ms

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


def _make(env: Any, name: str, args: argparse.Namespace) -> Any:
    from carpool.tools.bench import runners

    if name == "carpool":
        return runners.CarpoolSystem(env, args.timeout)
    if name in runners.POLICY_SYSTEMS:
        variant = name.split("-", 1)[1]
        extra = {"CARPOOL_BIN_EDGES": "auto"} if variant == "auto" else {"CARPOOL_POLICY": variant}
        system = runners.CarpoolSystem(env, args.timeout, extra_env=extra)
        system.name = name
        return system
    if name == "celery":
        return runners.PlainCelerySystem(env, args.timeout)
    if name == "celery-batches":
        return runners.CeleryBatchesSystem(env, args.timeout)
    if name == "asyncio":
        return runners.AsyncioSystem(args.model, args.max_batch, args.max_wait)
    raise ValueError(name)


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
    system = _make(env, name, args)
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
    from carpool.tools.bench import runners
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
            system = runners.CarpoolSystem(env, args.timeout, extra_env=overrides)
        else:
            system = runners.PlainCelerySystem(env, args.timeout)
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
    from carpool.tools.bench import runners

    batches = [int(v) for v in str(_opt(args, "sweep_batches")).split(",") if v.strip()]
    waits = [float(v) for v in str(_opt(args, "sweep_waits")).split(",") if v.strip()]
    (value, relative), *_ = parse_rates(args.sweep_rate)
    rate = value * offline_rps if relative else value
    result: dict[str, Any] = {"rate_rps": rate, "points": []}
    system = runners.CarpoolSystem(env, args.timeout)
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

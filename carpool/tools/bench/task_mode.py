"""``carpool bench --task``: a ``@batched`` task served by carpool, by celery-batches running the same
function, and by plain Celery one item per task; the same items through each, a burst then any rates.

    carpool bench --task reranker --model-dir /models/ms-marco-MiniLM-L-6-v2
    carpool bench --task myapp.search:rerank --items pairs.jsonl --requests 2000

``reranker`` is the built-in task (:mod:`carpool.tools.bench.rerank_task`): the cross-encoder in
``--model-dir``. A task of your own is ``package.module:attribute``, importable here and in the
processes the bench starts (installed, or on PYTHONPATH). Items come from ``--items`` (one JSON value
per line, repeated or cut to ``--requests``), else they are the built-in query/passage pairs of mixed
lengths (:func:`carpool.tools.workload.rerank_pairs`). Lengths, and so batch padding, are the task's
own ``length``. Each system's outputs for the first items are kept to show that they agree.

This module's top level imports only the standard library: the task module imports its names.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from carpool.tools.bench.systems.task import BenchTask

MODEL_DIR_ENV = "CARPOOL_BENCH_MODEL_DIR"  # --model-dir, for the task module in every process
RERANK_TASK = "carpool.bench.rerank"
BUILTIN_TASKS = {"reranker": "carpool.tools.bench.rerank_task:rerank"}
SAMPLES = 8  # outputs per system kept in the report, to compare the systems


def resolve_task(given: str, max_batch: int, model_dir: str | None = None) -> BenchTask:
    """The task ``given`` as ``package.module:attribute`` (or a built-in name), imported here.

    ``model_dir`` goes to this process's and every child's ``CARPOOL_BENCH_MODEL_DIR`` first, so the
    task module can read it when imported. Raises ``ValueError`` for a malformed or unknown task and
    :class:`~carpool.errors.ConfigError` for a module that cannot be imported.
    """
    import importlib

    from carpool.registry import BatchedSpec, import_task_modules, spec_for
    from carpool.tools.bench.systems.task import BenchTask

    target = BUILTIN_TASKS.get(given, given)
    module, _, attribute = target.partition(":")
    if not module or not attribute:
        raise ValueError(
            f"--task takes package.module:attribute (a @batched task) or one of "
            f"{', '.join(BUILTIN_TASKS)}, not {given!r}"
        )
    extra_env = {}
    if model_dir is not None:
        path = Path(model_dir).resolve()
        if not path.is_dir():
            raise ValueError(f"--model-dir {model_dir} is not a directory")
        extra_env[MODEL_DIR_ENV] = str(path)
        os.environ[MODEL_DIR_ENV] = str(path)
    elif target != given and not os.environ.get(MODEL_DIR_ENV):
        raise ValueError(f"--task {given} needs --model-dir (a local model directory)")
    import_task_modules([module])
    obj = getattr(importlib.import_module(module), attribute, None)
    name = getattr(obj, "name", None)
    spec = spec_for(name) if isinstance(name, str) else None
    if not isinstance(spec, BatchedSpec):
        raise ValueError(f"{module}:{attribute} is not a @batched task (found {obj!r:.80})")
    return BenchTask(
        name=spec.name, module=module, max_batch=spec.max_batch or max_batch, extra_env=extra_env
    )


def load_items(path: Path) -> list[Any]:
    """One JSON value per non-blank line of ``path``; a line that is not JSON raises ``ValueError``."""
    items = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                items.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON value ({exc})") from None
    if not items:
        raise ValueError(f"{path} holds no items")
    return items


def repeat_to(items: list[Any], count: int) -> list[Any]:
    """The first ``count`` items of ``items`` repeated as often as needed."""
    return [items[i % len(items)] for i in range(count)]


def task_lengths(task: str, items: list[Any]) -> list[int]:
    """The task's ``length`` of every item, as the coordinator computes it; ``ValueError`` if it fails."""
    from carpool.registry import BatchedSpec, spec_for

    spec = spec_for(task)
    assert isinstance(spec, BatchedSpec)
    try:
        lengths = spec.lengths(items)
    except Exception as exc:
        raise ValueError(
            f"{task}: length fails on the workload's items: {type(exc).__name__}: {exc}"
        ) from None
    bad = [i for i, n in enumerate(lengths) if not isinstance(n, int) or isinstance(n, bool) or n < 0]
    if bad:
        raise ValueError(f"{task}: length of item {bad[0]} is {lengths[bad[0]]!r}, not an int >= 0")
    return lengths


def _workload(args: argparse.Namespace) -> tuple[list[Any], str]:
    from carpool.tools.bench.runs import option
    from carpool.tools.workload import describe, rerank_pairs

    if args.items:
        items = load_items(Path(args.items))
        count = args.requests or len(items)
        return repeat_to(items, count), f"{args.items} ({len(items)} items)"
    count = int(option(args, "requests"))
    return rerank_pairs(count, args.seed), f"built-in [query, passage] pairs, passages of {describe()}"


def _rates(args: argparse.Namespace) -> list[float]:
    from carpool.tools.bench.measure import parse_rates

    if not args.rates or args.rates.strip().lower() == "none":
        return []
    rates = parse_rates(args.rates)
    if any(relative for _, relative in rates):
        raise ValueError("--task takes --rates in requests/s (there is no offline limit to multiply)")
    return sorted({value for value, _ in rates})


def run_task(args: argparse.Namespace) -> tuple[dict[str, Any], Path]:
    from carpool.registry import spec_for
    from carpool.tools.bench.env import BenchEnv
    from carpool.tools.bench.measure import length_stats
    from carpool.tools.bench.report import machine_info, now_iso
    from carpool.tools.bench.runs import option
    from carpool.tools.bench.systems.base import SEND_CHUNK
    from carpool.tools.bench.systems.task import TASK_SYSTEMS
    from carpool.tools.bench.task_report import SCHEMA, TOLERANCE, compare, validate_report

    if args.sweep:
        raise ValueError("--task runs no sweep; leave out --sweep")
    systems = [s.strip() for s in (args.systems or ",".join(TASK_SYSTEMS)).split(",") if s.strip()]
    unknown = sorted(set(systems) - set(TASK_SYSTEMS))
    if unknown:
        raise ValueError(f"--task compares {', '.join(TASK_SYSTEMS)}; not {', '.join(unknown)}")
    max_batch = int(option(args, "max_batch"))
    max_wait_s = float(option(args, "max_wait"))
    rates = _rates(args)
    task = resolve_task(args.task, max_batch, args.model_dir)
    items, source = _workload(args)
    if len(items) < 2:
        raise ValueError("--requests must be at least 2")
    lengths = task_lengths(task.name, items)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = spec_for(task.name)
    assert spec is not None  # resolve_task found it
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "created_at": now_iso(),
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "machine": machine_info(),
        "task": {
            "given": args.task,
            "name": task.name,
            "module": task.module,
            "max_batch": task.max_batch,
            "max_tokens": spec.max_tokens,
            "bins": spec.bin_edges,
        },
        "config": {
            "requests": len(items),
            "seed": args.seed,
            "max_batch": max_batch,
            "max_wait_s": max_wait_s,
            "workers": args.workers,
            "systems": systems,
            "rates": rates,
            "quick": bool(args.quick),
            "torch_threads": int(args.torch_threads or 0),
            "model_dir": task.extra_env.get(MODEL_DIR_ENV),
            "send_chunk": SEND_CHUNK,
        },
        "workload": {"source": source, "requests": len(items), "lengths": length_stats(lengths)},
        "runs": [],
        "comparison": {},
        "samples": {"items": items[:SAMPLES], "outputs": {}, "tolerance": TOLERANCE},
        "errors": [],
    }
    env_ = BenchEnv(
        out,
        "null",
        max_batch,
        max_wait_s,
        args.workers,
        torch_threads=int(args.torch_threads or 0),
        unix_socket=getattr(args, "redis", "tcp") == "unix",
    )
    with env_ as env:
        report["config"]["deadline_s"] = env.settings.default_deadline_s
        started = time.monotonic()
        warm = items[: 2 * task.max_batch]
        for name in systems:
            _run_system(env, name, task, warm, items, lengths, rates, args, report)
        report["config"]["elapsed_s"] = round(time.monotonic() - started, 1)
    report["comparison"] = compare(report["runs"], report["samples"]["outputs"])
    problems = validate_report(report)
    if problems:
        report["errors"].append({"system": "-", "phase": "schema", "error": "; ".join(problems)})
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report, out


def _run_system(
    env: Any,
    name: str,
    task: BenchTask,
    warm: list[Any],
    items: list[Any],
    lengths: list[int],
    rates: list[float],
    args: argparse.Namespace,
    report: dict[str, Any],
) -> None:
    from carpool.tools.bench.systems.task import make_task_system

    system = make_task_system(env, name, task, warm, args.timeout)
    phase = "start"
    try:
        _log(f"{name}: starting")
        system.start()
        phase = "burst"
        burst = system.burst(items, lengths)
        report["runs"].append(burst.to_dict())
        report["samples"]["outputs"][name] = [_jsonable(v) for v in system.last_values[:SAMPLES]]
        _log(f"{name}: burst {burst.throughput_rps:.1f} req/s, p99 {burst.latency_ms['p99']:.0f} ms")
        for i, rate in enumerate(rates):
            phase = f"rate {rate:g}"
            rec = system.rate(items, lengths, rate, args.seed + 2 + i)
            report["runs"].append(rec.to_dict())
            p99 = rec.latency_ms["p99"]
            _log(f"{name}: offered {rate:.1f}/s -> {rec.throughput_rps:.1f}/s, p99 {p99:.0f} ms")
    except Exception as exc:
        _log(f"{name} {phase} failed: {exc!r}")
        report["errors"].append(
            {"system": name, "phase": phase, "error": repr(exc), "traceback": traceback.format_exc(limit=8)}
        )
    finally:
        system.stop()
        env.flush()


def _jsonable(value: Any) -> Any:
    """An output as the report keeps it: a failed request as ``{"error": ...}``."""
    if isinstance(value, BaseException):
        return {"error": f"{type(value).__name__}: {value}"}
    return value


def _log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

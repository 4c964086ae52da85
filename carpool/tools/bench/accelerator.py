"""``carpool bench --accelerator PROFILE``: carpool in front of a fast (simulated) device, against what
the device alone does with the same workload.

One invocation, in order:

1. the workload (``ACCELERATOR_MIX``) tokenized in this process, single-threaded: the tokenizer's
   CPU per text (a reference; the report's tokenization is what the coordinators counted of their
   own prepare calls, the stats hash's ``prepare_cpu_ns``), and the token lengths;
2. the device's capacity on it (:func:`~carpool.tools.bench.device.device_capacity`);
3. carpool serving ``sim-<profile>`` (``--coordinators`` coordinators, one by default, and
   ``--workers`` workers, default settings):
   every text through ``submit_many(texts)`` then ``gather(results)``, timed from the submit call to
   gather's return; CPU per request of each process tree; the device's busy intervals;
4. the ``null`` model the same way (``--pipeline`` requests), then ``--light`` lone short requests;
5. plain Celery's no-op tasks (:mod:`~carpool.tools.bench.noop_app`, ``celery worker -P solo``):
   ``.delay()`` each, then ``.get()`` each;

then targets, plots and ``report.json`` (:mod:`~carpool.tools.bench.accelerator_report`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from carpool.tools.bench.env import BenchEnv
from carpool.tools.bench.measure import SHORT_TEXT, length_stats
from carpool.tools.bench.procstat import cpu_snapshot
from carpool.tools.bench.report import machine_info, now_iso

# Counts of a full run, and of ``--quick``; an option given on the command line wins over both.
FULL = {"requests": 6000, "light": 200, "pipeline": 20000}
QUICK = {"requests": 200, "light": 3, "pipeline": 200}
NOOP_TASKS = 3000  # plain Celery no-op tasks (fewer when --pipeline asks for fewer requests)
NOOP_WORKER = "celery-noop"
_ROLES = {"redis-server": "redis", NOOP_WORKER: "worker"}  # harness names that do not say their role


def resolve_profile(spec: str) -> tuple[str, Any, dict[str, str]]:
    """(model name, device profile, environment for the worker) for ``--accelerator spec``."""
    from carpool.errors import ConfigError
    from carpool.models.simdevice import PROFILES, profile_from

    try:
        profile = profile_from(spec.strip().lower())
    except ConfigError:
        raise ConfigError(
            f"--accelerator {spec!r}: use {', '.join(PROFILES)}, or a_s,b_s (seconds per batch, "
            "seconds per padded token, both >= 0), e.g. 0.0003,0.0000038"
        ) from None
    if spec.strip().lower() in PROFILES:
        return f"sim-{profile.name}", profile, {}
    return "sim", profile, {"CARPOOL_SIM_DEVICE": f"{profile.a_s!r},{profile.b_s!r}"}


def tokenizer_cpu_us(model: Any, texts: Sequence[str], passes: int = 3) -> tuple[float, list[int]]:
    """(CPU µs per text of ``model.encode`` over ``texts``, least of ``passes``; token lengths).

    Run with ``TOKENIZERS_PARALLELISM=false``, as carpool's processes run, so this is one core's work.
    """
    model.encode(list(texts[:64]))  # the tokenizer loads on first use
    best = float("inf")
    lengths: list[int] = []
    for _ in range(max(1, passes)):
        started = time.process_time()
        ids = model.encode(list(texts))
        best = min(best, time.process_time() - started)
        lengths = [len(row) for row in ids]
    return best / max(1, len(texts)) * 1e6, lengths


def _per_request_us(before: dict[str, float], after: dict[str, float], requests: int) -> dict[str, float]:
    """CPU µs per request of each component, from two :func:`cpu_snapshot` readings of the harness's
    processes (workers and coordinators summed by role)."""
    out = {"coordinator": 0.0, "worker": 0.0, "redis": 0.0}
    for name, value in after.items():
        role = _role(name)
        if role in (None, "producer") or name not in before:
            continue  # the bench's own process: its submit and gather are counted apart
        out[role] += (value - before[name]) / max(1, requests) * 1e6
    return out


def _background_cores(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Cores that processes outside the measurement kept busy meanwhile."""
    if "_busy" not in before or "_busy" not in after:
        return None
    ours = sum(after[k] - before[k] for k in after if not k.startswith("_") and k in before)
    wall = after["_wall"] - before["_wall"]
    return round(max(0.0, (after["_busy"] - before["_busy"]) - ours) / wall, 3) if wall > 0 else None


def burst(
    env: BenchEnv, texts: Sequence[str], timeout_s: float, timeline: bool = False, as_array: bool = False
) -> dict[str, Any]:
    """Every text through ``submit_many`` then ``gather``, as an application calls them; the wall
    time from the submit call to gather's return, and CPU per request of each component.
    ``timeline``: each component's CPU is also sampled over the run (``cpu_samples``, for
    :mod:`~carpool.tools.bench.cpu_timeline`).

    ``gather`` gets the bench's hang bound as its timeout; nothing else is passed but the bench's app
    (and ``as_array=True`` with ``as_array``).
    """
    from carpool.producer.gather import gather
    from carpool.producer.submit import submit_many
    from carpool.tools.bench.cpu_timeline import CpuSampler

    pids = {**env.harness.pids(), "producer": os.getpid()}
    gc.collect()  # what the bench built before (a burst's results among it) is not this burst's cost
    sampler = CpuSampler(_by_role(pids)) if timeline else None
    cpu_before = cpu_snapshot(pids)
    redis_before = _commandstats(env)
    if sampler is not None:
        sampler.start()
    wall_start = time.time()
    t0, p0 = time.perf_counter(), time.process_time()
    results = submit_many(texts, app=env.app)
    t1, p1 = time.perf_counter(), time.process_time()
    gather(results, timeout=timeout_s, as_array=as_array)
    t2, p2 = time.perf_counter(), time.process_time()
    samples = sampler.stop() if sampler is not None else None
    cpu_after = cpu_snapshot(pids)
    n = len(texts)
    cpu = _per_request_us(cpu_before, cpu_after, n)
    # The sampler thread runs in this process: its CPU is the bench's, not the producer's.
    sampler_s = sampler.own_cpu_s if sampler is not None else 0.0
    submit_s, gather_s = without_sampler(p1 - p0, p2 - p1, t1 - t0, t2 - t1, sampler_s)
    cpu["producer_submit"] = submit_s / n * 1e6
    cpu["producer_gather"] = gather_s / n * 1e6
    commands = {k: v - redis_before.get(k, 0) for k, v in _commandstats(env).items()}
    commands = {k: v for k, v in commands.items() if v and k != "info"}
    return {
        "requests": n,
        "wall_start": wall_start,
        "wall_s": t2 - t0,
        "submit_s": t1 - t0,
        "gather_s": t2 - t1,
        "throughput_rps": n / (t2 - t0),
        "cpu_us_per_request": {k: round(v, 1) for k, v in cpu.items()},
        "background_cpu_cores": _background_cores(cpu_before, cpu_after),
        "redis_commands_per_request": round(sum(commands.values()) / n, 3),
        # Taken off the producer's figures above (the bench's own sampling thread).
        "sampler_cpu_us_per_request": round(sampler_s / n * 1e6, 1),
        **({"cpu_samples": samples} if samples is not None else {}),
    }


def _role(name: str) -> str | None:
    """The component a harness process (or ``producer``, this one) belongs to."""
    if name == "producer":
        return name
    return _ROLES.get(name) or next((r for r in ("coordinator", "worker") if r in name), None)


def without_sampler(
    submit_cpu_s: float, gather_cpu_s: float, submit_wall_s: float, gather_wall_s: float, sampler_cpu_s: float
) -> tuple[float, float]:
    """The producer's submit and gather CPU without the CPU sampler's, which runs in the same process
    at a steady pace: shared out by wall time, never below zero."""
    wall = submit_wall_s + gather_wall_s
    share = submit_wall_s / wall if wall > 0 else 0.0
    return (
        max(0.0, submit_cpu_s - sampler_cpu_s * share),
        max(0.0, gather_cpu_s - sampler_cpu_s * (1.0 - share)),
    )


def _by_role(pids: dict[str, int]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for name, pid in pids.items():
        role = _role(name)
        if role is not None:
            out.setdefault(role, []).append(pid)
    return out


def _commandstats(env: BenchEnv) -> dict[str, int]:
    client = env.redis_client(0)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}


def plain_celery_noop(env: BenchEnv, texts: Sequence[str], timeout_s: float) -> dict[str, Any]:
    """``noop.delay(text)`` for every text, then ``.get()`` on each, against a ``celery worker -P solo``
    of :mod:`~carpool.tools.bench.noop_app` on the same Redis; timed from the first delay to the last
    get's return."""
    from celery.exceptions import TimeoutError as CeleryTimeout

    from carpool.tools.bench.env import BenchError
    from carpool.tools.bench.noop_app import NOOP_TASK, create_noop_app

    argv = ["celery", "-A", "carpool.tools.bench.noop_app", "worker", "-P", "solo"]
    argv += ["--loglevel", "warning", "-n", f"bench-noop-{os.getpid()}@%h"]
    env.harness.spawn(NOOP_WORKER, argv, **env.child_env())
    app = create_noop_app(env.harness.broker_url, env.harness.result_backend)
    noop = app.tasks[NOOP_TASK]
    try:
        deadline = time.monotonic() + 120
        while True:  # up: one task answered
            env.check_alive()
            try:
                noop.delay("warm up").get(timeout=2)
                break
            except CeleryTimeout:
                if time.monotonic() > deadline:
                    raise BenchError("plain Celery: the no-op worker did not answer in 120s") from None
        for r in [noop.delay(t) for t in texts[:20]]:
            r.get(timeout=timeout_s)
        pids = {**env.harness.pids(), "producer": os.getpid()}
        cpu_before = cpu_snapshot(pids)
        t0, p0 = time.perf_counter(), time.process_time()
        results = [noop.delay(t) for t in texts]
        for r in results:
            r.get(timeout=timeout_s)
        wall, producer = time.perf_counter() - t0, time.process_time() - p0
        cpu_after = cpu_snapshot(pids)
    finally:
        # Every result was got, so nothing is subscribed; close the pub/sub before its Redis goes.
        with contextlib.suppress(Exception):
            app.backend.result_consumer.stop()
        app.close()
        env.stop(NOOP_WORKER)
    n = len(texts)
    cpu = _per_request_us(cpu_before, cpu_after, n)
    cpu.pop("coordinator", None)
    cpu["producer"] = producer / n * 1e6
    return {
        "tasks": n,
        "wall_s": wall,
        "throughput_rps": n / wall,
        "cpu_us_per_request": {k: round(v, 1) for k, v in cpu.items()},
        "background_cpu_cores": _background_cores(cpu_before, cpu_after),
    }


def option(args: argparse.Namespace, name: str) -> int:
    value = getattr(args, name, None)
    return int(value if value is not None else (QUICK if args.quick else FULL)[name])


def run_accelerator(args: argparse.Namespace) -> tuple[dict[str, Any], Path]:
    """The whole accelerator-regime run; the report (also written to ``<out>/report.json``)."""
    from carpool.config import load_settings
    from carpool.models import get_model
    from carpool.tools.bench.accelerator_report import SCHEMA, evaluate_targets, validate_report
    from carpool.tools.bench.device import device_capacity
    from carpool.tools.bench.plots import write_accelerator_plots
    from carpool.tools.workload import ACCELERATOR_MIX, describe, mixed_texts

    if args.sweep:
        raise ValueError("--accelerator and --sweep are separate modes; give one")
    if getattr(args, "as_array", False):
        # As an application that gathers arrays has: imported at start, not inside the burst.
        import numpy  # noqa: F401
    model_name, profile, sim_env = resolve_profile(args.accelerator)
    n = option(args, "requests")
    if n < 2:
        raise ValueError("--requests must be at least 2")
    if args.workers < 1:
        raise ValueError("--workers must be at least 1")
    light, pipeline_n = option(args, "light"), option(args, "pipeline")
    defaults = load_settings()  # the service's settings, as a user's processes would read them
    max_batch = args.max_batch if args.max_batch is not None else defaults.max_batch
    max_wait_s = args.max_wait if args.max_wait is not None else defaults.max_wait_s
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device_log = out / f"device-{profile.name}.log"
    device_log.unlink(missing_ok=True)

    # One core's tokenizer, as carpool's processes run it (they get the same setting from the bench).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    texts = mixed_texts(n, args.seed, ACCELERATOR_MIX)
    _log(f"{n} texts; tokenizing in this process")
    tokenizer_us, lengths = tokenizer_cpu_us(get_model(model_name), texts)
    # Each worker process simulates a device of its own: N workers have N devices' capacity.
    capacity = device_capacity(lengths, profile.a_s, profile.b_s, max_batch, devices=args.workers)
    _log(f"{args.workers} x {profile.name}: capacity {capacity['texts_per_s']:.0f} texts/s on this workload")
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "created_at": now_iso(),
        "command": " ".join(shlex.quote(a) for a in sys.argv),
        "machine": machine_info(),
        "model": model_name,
        "device": {"profile": profile.name, "a_s": profile.a_s, "b_s": profile.b_s},
        "config": {
            "requests": n,
            "seed": args.seed,
            "max_batch": max_batch,
            "max_wait_s": max_wait_s,
            "workers": args.workers,
            "coordinators": args.coordinators,
            "light": light,
            "pipeline": pipeline_n,
            "noop_tasks": min(NOOP_TASKS, pipeline_n),
            "quick": bool(args.quick),
            "gather_timeout_s": args.timeout,
            "profile": bool(args.profile),
            "redis": getattr(args, "redis", "tcp"),  # how the processes reach redis-server
            # The burst gathered as one numpy array (gather's as_array) instead of lists.
            "as_array": bool(getattr(args, "as_array", False)),
            # Task events as the processes build them (auto: only while some client receives them).
            "events": os.environ.get("CARPOOL_EVENTS", "auto"),
            # How results are stored (json: each float's shortest decimal; msgpack: the float32 itself).
            "result_serializer": defaults.result_serializer,
        },
        "workload": {
            "requests": n,
            "seed": args.seed,
            "length_distribution": describe(ACCELERATOR_MIX) + " (word counts)",
            "chars_mean": sum(len(t) for t in texts) / n,
            "token_lengths": length_stats(lengths),
            "at_window_share": sum(1 for v in lengths if v >= get_model(model_name).max_length) / n,
        },
        "tokenizer_cpu_us_per_text": round(tokenizer_us, 1),
        "capacity": capacity,
        "carpool": None,
        "device_busy": None,
        "pipeline": None,
        "light": None,
        "targets": [],
        "plots": [],
        "errors": [],
    }
    if args.coordinators < 1:
        raise ValueError("--coordinators must be at least 1")
    env_ = BenchEnv(
        out,
        model_name,
        max_batch,
        max_wait_s,
        args.workers,
        ("null",),
        profile=args.profile,
        coordinators=args.coordinators,
        unix_socket=getattr(args, "redis", "tcp") == "unix",
    )
    with env_ as env:
        _simulated_device(env, args, texts, tokenizer_us, capacity, device_log, sim_env, report)
        _null_pipeline(env, args, pipeline_n, light, report)
        env.stop_all()
        if args.profile:
            report["config"]["profiles"] = sorted(env.summarize_profiles())
    report["machine"]["load_average_end"] = [round(v, 2) for v in os.getloadavg()]
    report["targets"] = evaluate_targets(report)
    try:
        report["plots"] = write_accelerator_plots(report, out)
    except Exception as exc:  # a plot failure must not lose the numbers
        report["errors"].append({"phase": "plots", "error": repr(exc)})
    problems = validate_report(report)
    if problems:
        report["errors"].append({"phase": "schema", "error": "; ".join(problems)})
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report, out


def _simulated_device(
    env: BenchEnv,
    args: argparse.Namespace,
    texts: list[str],
    tokenizer_us: float,
    capacity: dict[str, float],
    device_log: Path,
    sim_env: dict[str, str],
    report: dict[str, Any],
) -> None:
    """carpool on the simulated device: the burst, its batches, CPU and the device's busy time."""
    from carpool.models.simdevice import DEVICE_LOG_ENV
    from carpool.tools.bench.device import busy_summary, nominal_device_s, read_device_log
    from carpool.tools.bench.systems.base import counters_since
    from carpool.tools.bench.systems.carpool import CarpoolSystem

    system = CarpoolSystem(env, args.timeout, extra_env={**sim_env, DEVICE_LOG_ENV: str(device_log)})
    phase = "start"
    try:
        _log(f"carpool on {env.model}: starting")
        system.start()
        time.sleep(0.5)  # let the warm-up's stragglers (events, reports) settle
        phase = "burst"
        before = system.snapshot()
        _log(f"carpool on {env.model}: a burst of {len(texts)} texts")
        run = burst(env, texts, args.timeout, timeline=True, as_array=getattr(args, "as_array", False))
        time.sleep(0.6)  # batch counters reach Redis a moment after the last result
        after = system.snapshot()
        sizes, padded, real = counters_since(before, after)
    except Exception as exc:
        _error(report, f"carpool {phase}", exc)
        return
    finally:
        system.stop()  # the workers write the rest of the device log as they exit
        env.flush()
    cpu = run["cpu_us_per_request"]
    # Tokenization as the coordinators counted it (their prepare calls' thread CPU: stats hash),
    # over the same requests as their whole CPU; the bench's own one-thread figure only if absent.
    prepare_ns = after.get("prepare_cpu_ns", 0.0) - before.get("prepare_cpu_ns", 0.0)
    tokenization = prepare_ns / 1e3 / len(texts) if prepare_ns > 0 else tokenizer_us
    cpu["tokenization"] = round(tokenization, 1)
    cpu["coordinator_besides_tokenization"] = round(cpu["coordinator"] - tokenization, 1)
    run["tokenization_counted_by"] = "coordinator" if prepare_ns > 0 else "bench"
    run["ratio_to_capacity"] = run["throughput_rps"] / capacity["texts_per_s"]
    run["batches"] = sum(sizes.values())
    run["mean_batch"] = (sum(k * v for k, v in sizes.items()) / run["batches"]) if run["batches"] else None
    run["padding_ratio"] = padded / real if padded and real else None
    end = run["wall_start"] + run["wall_s"]
    forwards = [f for f in read_device_log(device_log) if run["wall_start"] <= f.start < end]
    busy = busy_summary(forwards, run["wall_start"], end, devices=env.workers)
    profile = report["device"]
    busy["device_s_nominal"] = nominal_device_s(forwards, profile["a_s"], profile["b_s"])
    # The device's own time on carpool's batches against the sorted ideal: what batching alone costs.
    run["batching_efficiency"] = capacity["device_s"] / busy["device_s_nominal"] if forwards else None
    samples = run.pop("cpu_samples", None)
    report["carpool"] = run
    report["device_busy"] = busy
    if samples:
        report["cpu_over_run"] = cpu_over_run(samples, run["wall_start"], end, busy)
    _log(
        f"carpool: {run['throughput_rps']:.0f} texts/s = {run['ratio_to_capacity']:.2f} x capacity; "
        f"device busy {busy['overall']:.2f} of the run"
    )


def cpu_over_run(samples: list[Any], start: float, end: float, busy: dict[str, Any]) -> dict[str, Any]:
    """Cores each component used per bucket of the device's busy series, over the whole run, and
    where the device waited and where it was saturated (:mod:`~carpool.tools.bench.cpu_timeline`)."""
    from carpool.tools.bench.cpu_timeline import cores_per_bucket, starved_and_saturated

    cores = cores_per_bucket(samples, start, end, busy["bucket_s"])
    whole = {
        name: (series[0] if series else 0.0)
        for name, series in cores_per_bucket(samples, start, end, end - start).items()
    }
    count = min((len(series) for series in cores.values()), default=0)
    return {
        "bucket_s": busy["bucket_s"],
        "machine_cores": os.cpu_count(),
        "whole_run": {"total_cores": round(sum(whole.values()), 3), "cores": whole},
        "components": cores,
        "total": [round(sum(series[i] for series in cores.values()), 3) for i in range(count)],
        **starved_and_saturated(cores, busy["buckets"]),
    }


def _null_pipeline(
    env: BenchEnv, args: argparse.Namespace, count: int, light: int, report: dict[str, Any]
) -> None:
    """The null model through carpool (burst, then light load), and plain Celery's no-op tasks."""
    from carpool.tools.bench.systems.carpool import CarpoolSystem
    from carpool.tools.workload import mixed_texts

    if not count and not light:
        return
    texts = mixed_texts(max(count, 1), args.seed + 7)
    pipeline: dict[str, Any] = {"model": "null", "carpool": None, "celery_noop": None, "ratio": None}
    system = CarpoolSystem(env, args.timeout, extra_env={"CARPOOL_MODEL": "null", "CARPOOL_MODELS": "null"})
    system.model = "null"
    phase = "start"
    try:
        _log("carpool on null: starting")
        system.start()
        if count:
            phase = "pipeline"
            run = burst(env, texts, args.timeout)
            run.pop("wall_start")
            pipeline["carpool"] = run
            _log(f"pipeline carpool: {run['throughput_rps']:.0f} req/s")
        if light:
            phase = "light"
            rec = system.light(SHORT_TEXT, light, None)
            report["light"] = {"requests": rec.requests, "latency_ms": rec.latency_ms, **rec.extra}
            _log(f"light: p50 {rec.latency_ms['p50']:.1f} ms, p99 {rec.latency_ms['p99']:.1f} ms")
    except Exception as exc:
        _error(report, f"carpool null {phase}", exc)
    finally:
        system.stop()
        env.flush()
    if count:
        try:
            _log("plain Celery no-op: starting")
            noop = plain_celery_noop(env, texts[: min(NOOP_TASKS, count)], args.timeout)
            pipeline["celery_noop"] = noop
            _log(f"pipeline plain Celery: {noop['throughput_rps']:.0f} tasks/s")
        except Exception as exc:
            _error(report, "plain Celery no-op", exc)
        finally:
            env.flush()
        if pipeline["carpool"] and pipeline["celery_noop"]:
            pipeline["ratio"] = (
                pipeline["carpool"]["throughput_rps"] / pipeline["celery_noop"]["throughput_rps"]
            )
        report["pipeline"] = pipeline


def _log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _error(report: dict[str, Any], phase: str, exc: BaseException) -> None:
    import traceback

    _log(f"{phase} failed: {exc!r}")
    report["errors"].append({"phase": phase, "error": repr(exc), "traceback": traceback.format_exc(limit=8)})

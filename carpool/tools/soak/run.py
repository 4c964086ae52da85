"""One soak, in order: start the stack, hold the load while faults come on schedule, drain, read
the counters, stop; then judge (:mod:`carpool.tools.soak.report`) and plot."""

from __future__ import annotations

import queue
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from carpool.redis_edge import reply_text
from carpool.tools.arrivals import poisson_times
from carpool.tools.soak.chaos import Sampler, Stack, fault_plan
from carpool.tools.soak.config import SoakConfig
from carpool.tools.soak.load import Collector, Request, Sender
from carpool.tools.soak.model import NAME as MODEL


def _log(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def expected_check(texts: Sequence[str]) -> Callable[[int, Any], bool]:
    """``check(i, value)``: whether ``value`` is the toy model's output for ``texts[i]`` run alone
    (within 1e-4: batch shapes change float32 rounding)."""
    import numpy as np

    from carpool.gpu_worker.runner import loaded_model, run_padded

    model = loaded_model("toy")
    want = [np.asarray(run_padded(model, [ids], [len(ids)])[0]) for ids in model.encode(list(texts))]

    def check(i: int, value: Any) -> bool:
        try:
            got = np.asarray(value, dtype=float)
        except (TypeError, ValueError):
            return False
        return got.shape == want[i].shape and bool(np.allclose(got, want[i], atol=1e-4))

    return check


def run_soak(
    config: SoakConfig, out_dir: Path | None = None, log: Callable[[str], None] = _log
) -> dict[str, Any]:
    """Run ``config``; the report (see :func:`carpool.tools.soak.report.build_report`), also written
    with its plot to ``out_dir`` when given."""
    from carpool.tools.harness import release_result_consumer
    from carpool.tools.soak.report import build_report, write_report
    from carpool.tools.workload import mixed_texts

    texts = mixed_texts(config.texts, seed=config.seed)
    check = expected_check(texts)
    log_dir = (out_dir / "logs") if out_dir is not None else Path(tempfile.mkdtemp(prefix="carpool-soak-"))
    stack = Stack(config, log_dir)
    app: Any = None
    try:
        log(
            f"starting redis (AOF, fsync always), {config.coordinators} coordinators, "
            f"{config.workers} workers"
        )
        stack.start()
        app = _producer_app(stack, config)
        offsets = [
            t for t in poisson_times(_arrivals(config), config.rate_rps, config.seed, first_at_zero=True)
        ]
        offsets = [t for t in offsets if t < config.duration_s]
        log(
            f"load: {len(offsets)} requests over {config.duration_s:.0f}s at {config.rate_rps:.1f}/s "
            f"({config.load_fraction:g} of {config.capacity_rps:.1f}/s); faults every "
            f"{config.interval_s[0]:g}-{config.interval_s[1]:g}s after a {config.lead_in_s:g}s lead-in"
        )
        handoff: queue.SimpleQueue[list[Request]] = queue.SimpleQueue()
        start = time.time() + 0.5
        sender = Sender(app, MODEL, texts, offsets, start, config.send_give_up_s, handoff)
        collector = Collector(stack.client(1), handoff, check, config.poll_s, config.recheck_after_s)
        sampler = Sampler(stack, config.memory_every_s, start)
        for thread in (collector, sampler, sender):
            thread.start()
        faults = []
        for at_s, kind in fault_plan(config):
            time.sleep(max(0.0, start + at_s - time.time()))
            fault = stack.inject(kind, time.time() - start)
            faults.append(fault)
            log(f"t={fault['at_s']:.0f}s killed {fault['target']} ({fault['in_flight_at_fault']} in flight)")
        sender.join(timeout=max(0.0, start + config.duration_s - time.time()) + config.send_give_up_s + 10)
        sender.stop.set()
        log(f"load done; draining (up to {config.drain_timeout_s:.0f}s)")
        _wait(lambda: not collector.pending and handoff.empty(), config.drain_timeout_s)
        collector.final.set()
        _wait(lambda: collector.outstanding() == 0, 30.0)
        collector.stop.set()
        collector.join(timeout=10)
        sampler.stop.set()
        sampler.join(timeout=10)
        leftovers = _leftovers(stack)
        report = build_report(
            config,
            requests=sender.requests,
            faults=faults,
            sampler=sampler,
            start=start,
            counters=leftovers,
            producer={"send_failures": sender.send_failures, "read_failures": collector.read_failures},
        )
    finally:
        if app is not None:
            release_result_consumer(app)
        stack.close()
    if out_dir is not None:
        write_report(report, out_dir)
    return report


def _arrivals(config: SoakConfig) -> int:
    """Enough Poisson arrivals to outlast ``duration_s`` with near certainty."""
    expected = config.rate_rps * config.duration_s
    return int(expected + 6 * expected**0.5 + 10)


def _producer_app(stack: Stack, config: SoakConfig) -> Any:
    from carpool.celery_edge.app import create_app
    from carpool.config import load_settings

    return create_app(
        load_settings(
            broker_url=stack.server.url(0),
            result_backend=stack.server.url(1),
            model=MODEL,
            models=(MODEL,),
            result_expires_s=config.result_expires_s,
        )
    )


def _wait(done: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _leftovers(stack: Stack) -> dict[str, Any]:
    """The stats counters, and what is still queued, in flight or dead-lettered after the drain."""
    client = stack.client()
    try:
        raw = client.hgetall(stack.keys.stats)
        stats = {reply_text(k): int(float(v)) for k, v in raw.items()}
        with client.pipeline(transaction=False) as pipe:
            for key in stack.keys.request_lists:
                pipe.llen(key)
            pipe.zcard(stack.keys.inflight_lease)
            pipe.llen(stack.keys.dead_letter)
            *queued, in_flight, dead = pipe.execute()
        return {"stats": stats, "queued": sum(queued), "in_flight": in_flight, "dead_letter": dead}
    finally:
        client.close()

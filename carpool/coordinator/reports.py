"""Batch reports back from the workers: each closes its outstanding batch and teaches the latency model."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from carpool.errors import WireError
from carpool.wire import read_report

if TYPE_CHECKING:
    from carpool.coordinator.loop import Coordinator

log = logging.getLogger(__name__)


def apply_reports(c: Coordinator, reports: list[dict[str, Any]]) -> None:
    for raw in reports:
        try:
            report = read_report(raw)
        except WireError as exc:
            _refuse_report(c, raw, exc)
            continue
        c.pacer.changed()  # a slot freed, and the latency model learnt something
        out = c.outstanding.pop(report["batch_id"], None)
        if out is None:
            log.debug("report for batch %s dispatched by another coordinator", report["batch_id"])
        run_s = report["run_s"]
        if report["padded_tokens"] and run_s is not None:
            c.latency.observe(report["model"], report["padded_tokens"], run_s)
            c.metrics.batch_ran(report["model"], report["device"], run_s)
        # Failures decided on the worker count with the coordinator's own, in metrics and stats.
        for reason, n in (("model", report["failed_model"]), ("deadline", report["failed_deadline"])):
            if n:
                c.stats.failed[reason] += n
                c.metrics.failed(reason, n)


def give_up_unreported(c: Coordinator, now: float) -> None:
    """Forget the batches that no report closed within a lease (and four predicted run times).

    Most died with their worker: the reap (here or in another coordinator) brings their requests
    back. One still running (a slow function) keeps its requests leased by its worker, and reports
    when it ends."""
    horizon = c.settings.recovery_timeout_s
    for batch_id, out in list(c.outstanding.items()):
        if now - out.dispatched_s > horizon + 4 * out.predicted_s:
            log.warning(
                "batch %s (%d requests) not reported within %.0f s; no longer counted as its worker's"
                " work (still running, it keeps its requests; if its worker died, recovery returns them)",
                batch_id,
                len(out.ids),
                now - out.dispatched_s,
            )
            del c.outstanding[batch_id]


def _refuse_report(c: Coordinator, raw: object, exc: WireError) -> None:
    """Log a report this release cannot read: loudly the first time, then quietly."""
    kind = (type(exc).__name__, repr(raw.get("version")) if isinstance(raw, dict) else "")
    if kind in c.refused_report_kinds:
        log.debug("batch report refused: %s", exc)
        return
    c.refused_report_kinds.add(kind)
    log.error("batch report refused (more like it are logged at debug level): %s", exc)

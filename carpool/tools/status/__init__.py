"""``carpool status``: a live terminal view of one carpool deployment, read from Redis.

Everything shown comes from Redis, so it works from any machine that reaches the broker and needs
neither torch nor a metrics port:

* queue depth: the request lists ``.delay()`` writes to (one per priority step), plus what the
  coordinators hold (``pending``, and per length bin ``depth:<model>:<bin>``, shown under the
  model's task ``task:<model>``: each live coordinator's gauges, ``carpool:<queue>:gauges:<hostname>``,
  summed);
* workers online: the heartbeat ZSET ``carpool:<queue>:workers`` (members with a live expiry);
* rates: deltas of the coordinators' counters (``carpool:<queue>:stats``) over the refresh interval;
* padding ratio, flush reasons, failures, batch sizes, in-flight requests, dead-letter length.

``--once`` prints one snapshot and exits (for scripts); ``--json`` prints it as JSON. Both sample the
counters twice, ``--interval`` apart, so rates are real; ``--interval 0`` skips rates.
"""

from __future__ import annotations

from carpool.tools.status.cli import DEFAULT_INTERVAL_S, add_parser, main, run_cli
from carpool.tools.status.snapshot import Rates, Snapshot, as_dict, collect, rates, snapshot_dict
from carpool.tools.status.view import render

__all__ = [
    "DEFAULT_INTERVAL_S",
    "Rates",
    "Snapshot",
    "add_parser",
    "as_dict",
    "collect",
    "main",
    "rates",
    "render",
    "run_cli",
    "snapshot_dict",
]

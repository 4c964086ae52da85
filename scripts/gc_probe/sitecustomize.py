"""Every garbage collection of every Python process started with this folder on ``PYTHONPATH``: when
it began (wall clock), its generation, how long it took and what it freed, written at exit to
``$CARPOOL_GC_PROBE_DIR/gc-<pid>.json`` (default: the system's temporary folder).

    CARPOOL_GC_PROBE_DIR=/tmp/gc PYTHONPATH=scripts/gc_probe:$PWD \
        carpool bench --accelerator v100 --pipeline 0 --light 0 --out OUT
    python scripts/gc_in_burst.py OUT /tmp/gc

Python imports ``sitecustomize`` at start-up, so the bench's own process, its coordinator and its
worker (which inherit the environment) all record theirs; carpool carries no probe of its own.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import tempfile
import time
from typing import Any

_events: list[tuple[float, int, float, int]] = []
_started = [0.0, 0.0]


def _record(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        _started[0], _started[1] = time.perf_counter(), time.time()
    else:
        _events.append(
            (_started[1], int(info["generation"]), time.perf_counter() - _started[0], int(info["collected"]))
        )


def _write() -> None:
    folder = os.environ.get("CARPOOL_GC_PROBE_DIR") or tempfile.gettempdir()
    with open(os.path.join(folder, f"gc-{os.getpid()}.json"), "w") as f:
        json.dump({"argv": sys.argv, "collections": _events}, f)


gc.callbacks.append(_record)
atexit.register(_write)

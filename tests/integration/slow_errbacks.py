"""A new-style error callback, ``(request, exc, traceback)``, that Celery calls in the process that
fails the request (CARPOOL_IMPORTS=tests.integration.slow_errbacks): it writes
``started-<request id>`` in the folder ``CARPOOL_TEST_ERRBACK_DIR`` names, waits until a file
``release`` appears there (30 s at most), then writes ``done-<request id>``."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from carpool.celery_app import app

WAIT_S = 30.0


@app.task(name="tests.slow_errbacks.waits_for_release")  # type: ignore[untyped-decorator, unused-ignore]
def waits_for_release(request: Any, exc: Any, traceback: Any) -> None:
    folder = Path(os.environ["CARPOOL_TEST_ERRBACK_DIR"])
    (folder / f"started-{request.id}").write_text(str(exc))
    deadline = time.monotonic() + WAIT_S
    while not (folder / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    (folder / f"done-{request.id}").write_text(str(exc))

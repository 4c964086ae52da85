"""New-style error callbacks, ``(request, exc, traceback)``, which Celery calls in the process that
fails the request (CARPOOL_IMPORTS=tests.integration.slow_errbacks): for a refusal, the coordinator.

``waits_for_release`` writes ``started-<request id>`` in the folder ``CARPOOL_TEST_ERRBACK_DIR``
names, waits until a file ``release`` appears there (30 s at most), then writes
``done-<request id>``; ``kills_its_process`` SIGKILLs the process calling it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from carpool.celery_app import app

WAIT_S = 30.0


@app.task(name="tests.slow_errbacks.waits_for_release")  # type: ignore[untyped-decorator, unused-ignore]
def waits_for_release(request: Any, exc: Any, traceback: Any) -> None:
    """Holds the process calling it until the test releases it."""
    folder = Path(os.environ["CARPOOL_TEST_ERRBACK_DIR"])
    (folder / f"started-{request.id}").write_text(str(exc))
    deadline = time.monotonic() + WAIT_S
    while not (folder / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    (folder / f"done-{request.id}").write_text(str(exc))


@app.task(name="tests.slow_errbacks.kills_its_process")  # type: ignore[untyped-decorator, unused-ignore]
def kills_its_process(request: Any, exc: Any, traceback: Any) -> None:
    """Stands for an error callback that takes its process down (out of memory, a crash in native
    code): the coordinator calling it, each time."""
    os.kill(os.getpid(), signal.SIGKILL)

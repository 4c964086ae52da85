"""Imported by a worker (CARPOOL_IMPORTS) started with ``CARPOOL_TEST_DIE_BEFORE_LINKS=N``: from then
on the worker sends no links after storing a batch's results (as if it died right there, the one
moment a crash once lost them), and at the Nth such batch it is killed (SIGKILL) at that point."""

from __future__ import annotations

import os
import signal
from typing import Any

_DIE_AT = int(os.environ.get("CARPOOL_TEST_DIE_BEFORE_LINKS") or 0)

if _DIE_AT:
    from carpool.gpu_worker import runtime

    _calls = 0

    def _die(*_: Any, **__: Any) -> None:
        global _calls
        _calls += 1
        if _calls >= _DIE_AT:
            os.kill(os.getpid(), signal.SIGKILL)

    setattr(runtime, "apply_links", _die)  # noqa: B010  # the name runtime calls, not re-exported
    runtime.WorkerRuntime._links_sent = lambda *_: None  # type: ignore[method-assign]

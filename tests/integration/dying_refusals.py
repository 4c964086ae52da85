"""Imported by a coordinator (CARPOOL_IMPORTS) started with ``CARPOOL_TEST_DIE_BEFORE_ERRBACKS=1``: at
the first error callback it would call (a refused request's), it is killed (SIGKILL) instead: after
the refusal is stored, before its error callbacks are sent."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace
from typing import Any

if os.environ.get("CARPOOL_TEST_DIE_BEFORE_ERRBACKS"):
    from carpool.coordinator import answers

    def _die(*_: Any, **__: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    # Only the refusal path's name: the outbox's own sends (a later coordinator's) stay as they are.
    refusal_links = SimpleNamespace(**{**vars(answers.links), "on_failure": _die})  # type: ignore[attr-defined]
    setattr(answers, "links", refusal_links)  # noqa: B010  # the name answers calls, not re-exported

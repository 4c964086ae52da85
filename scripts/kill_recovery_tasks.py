"""The ``@batched`` task ``scripts/kill_recovery.py`` serves (``CARPOOL_IMPORTS=kill_recovery_tasks``)."""

from __future__ import annotations

import os
import time

from carpool import batched


@batched(length=len, max_batch=16, name="kill_recovery.sleepy")
def sleepy(texts: list[str]) -> list[str]:
    """Each batch sleeps ``KILL_RECOVERY_BATCH_S`` whatever its size: a window to kill its worker."""
    time.sleep(float(os.environ.get("KILL_RECOVERY_BATCH_S", "0.2")))
    return [t.upper() for t in texts]

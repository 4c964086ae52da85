"""The systems ``carpool bench`` compares, one module each, and the factory that picks one by name.

Every system answers ``start``, ``burst``, ``rate``, ``light`` and ``stop`` with
:class:`~carpool.tools.bench.measure.RunRecord` values. Networked systems (carpool, plain Celery,
celery-batches) share the bench's one redis-server, producer and clock (:mod:`.base`); only one
system's processes run at a time, and Redis is flushed between systems.
"""

from __future__ import annotations

from typing import Any

from carpool.tools.bench.env import BenchEnv

SYSTEMS = ("offline", "carpool", "celery", "celery-batches", "asyncio")
# carpool under its other queueing policies, to compare policies in one run (not run by default).
POLICY_SYSTEMS = ("carpool-fifo", "carpool-shortest", "carpool-auto")


def make_system(
    env: BenchEnv, name: str, model: str, max_batch: int, max_wait_s: float, timeout_s: float
) -> Any:
    """The system called ``name`` (any of SYSTEMS but offline, or of POLICY_SYSTEMS), not started."""
    from carpool.tools.bench.systems.baseline_workers import CeleryBatchesSystem, PlainCelerySystem
    from carpool.tools.bench.systems.carpool import CarpoolSystem
    from carpool.tools.bench.systems.in_process import AsyncioSystem

    if name == "carpool":
        return CarpoolSystem(env, timeout_s)
    if name in POLICY_SYSTEMS:
        variant = name.split("-", 1)[1]
        extra = {"CARPOOL_BIN_EDGES": "auto"} if variant == "auto" else {"CARPOOL_POLICY": variant}
        system = CarpoolSystem(env, timeout_s, extra_env=extra)
        system.name = name
        return system
    if name == "celery":
        return PlainCelerySystem(env, timeout_s)
    if name == "celery-batches":
        return CeleryBatchesSystem(env, timeout_s)
    if name == "asyncio":
        return AsyncioSystem(model, max_batch, max_wait_s)
    raise ValueError(name)

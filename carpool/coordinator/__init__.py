"""The coordinator: drains Celery request messages from Redis into length-binned micro-batches.

``loop`` runs the process (Redis and Celery I/O, orchestration), ``intake`` turns taken messages
into the policy's requests, ``waiting`` decides how the loop waits between steps, ``metrics`` serves
Prometheus metrics and ``stats`` writes the counters ``carpool status`` reads. The batching decisions
themselves live in the pure ``carpool.batching``.
"""

from __future__ import annotations

from carpool.batching import PolicyConfig
from carpool.config import Settings


def policy_config(settings: Settings) -> PolicyConfig:
    """The batching policy's configuration from the settings (the simulator uses it too)."""
    return PolicyConfig(
        kind=settings.policy,
        max_batch=settings.max_batch,
        max_tokens=settings.max_tokens,
        max_wait_s=settings.max_wait_s,
        wait_factor=settings.wait_factor,
        bin_edges=settings.bin_edges,
        auto_bins=settings.auto_bins,
    )


__all__ = ["policy_config"]

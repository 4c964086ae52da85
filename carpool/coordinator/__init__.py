"""The coordinator: drains Celery request messages from Redis into length-binned micro-batches.

``loop`` runs the process (its steps and the waits between them), ``intake`` turns taken messages
into the policy's requests, ``stage`` does so for a large take on threads while the loop goes on,
``admission`` puts them into the policy, ``deferred`` holds requests until their eta, ``revokes``
hears Celery's revoke broadcasts, ``answers`` stores what the coordinator answers itself (refusals,
revokes, dead letters), ``waiting`` decides how the loop waits between steps, ``dispatch`` carries
out the policy's plan, ``publish`` hands batches to workers, ``reports`` reads the workers' batch
reports, ``metrics`` serves Prometheus metrics, ``stats`` writes the gauges and counters
``carpool status`` reads, and ``signals`` turns SIGTERM and SIGINT into the loop's stop. The
batching decisions themselves live in the pure ``carpool.batching``.
"""

from __future__ import annotations

import dataclasses

from carpool.batching import PolicyConfig
from carpool.config import Settings
from carpool.registry import TaskSpec


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
        tight_backlog=settings.tight_backlog,
        prefetch_s=settings.prefetch_s,
    )


def task_policy_config(base: PolicyConfig, spec: TaskSpec) -> PolicyConfig:
    """``base`` with the limits and bins a task names for itself, and its lengths rounded up to the
    multiple its worker pads to."""
    changes: dict[str, object] = {"pad_multiple": spec.pad_multiple}
    if spec.max_batch is not None:
        changes["max_batch"] = spec.max_batch
    if spec.max_tokens is not None:
        changes["max_tokens"] = spec.max_tokens
    if spec.bin_edges == "auto":
        changes["auto_bins"] = base.auto_bins or 6
    elif spec.bin_edges is not None:
        changes.update(bin_edges=spec.bin_edges, auto_bins=0)
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


__all__ = ["policy_config", "task_policy_config"]

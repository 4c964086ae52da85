"""Timestamps at each hop of a request's path, for ``scripts/light_latency.py``; imported by the
coordinator and the worker through ``CARPOOL_IMPORTS=hoptrace`` (with this folder on PYTHONPATH).

Importing it wraps the functions that mark a hop (the coordinator's wait, take, policy and dispatch;
kombu's BRPOP on the worker, its claim, run and finish) so that each appends ``<hop> <ns>`` to
``$CARPOOL_HOPTRACE_DIR/<pid>.trace`` with ``time.perf_counter_ns()`` (CLOCK_MONOTONIC on Linux,
one clock for every process). The service itself carries no tracing: this is test equipment, and
wraps only names that main's tree has too, so the same script measures a baseline checkout.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from typing import Any

_fd: int | None = None


def record(hop: str) -> None:
    """Append ``hop`` and the time now to this process's trace file."""
    if _fd is not None:
        os.write(_fd, f"{hop} {time.perf_counter_ns()}\n".encode())


def _wrap(
    owner: Any, name: str, before: str | None, after: str | None, when: Callable[[Any], bool] | None = None
) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def traced(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            record(before)
        out = original(*args, **kwargs)
        if after is not None and (when is None or when(out)):
            record(after)
        return out

    setattr(owner, name, traced)


def _install_coordinator() -> None:
    from carpool.batching.policy import BatchPolicy
    from carpool.coordinator.loop import Coordinator
    from carpool.redis_edge.store import RequestStore

    _wrap(Coordinator, "_wait", None, "c_wake")
    _wrap(RequestStore, "take", None, "c_taken", lambda out: bool(out[0]))
    if hasattr(RequestStore, "wait_then_take"):  # the take runs in Redis behind the wait
        original = RequestStore.wait_then_take

        @functools.wraps(original)
        def waited(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if out[1] is not None and out[1][0]:
                record("c_wake")
                record("c_taken")
            return out

        RequestStore.wait_then_take = waited  # type: ignore[method-assign]
    _wrap(BatchPolicy, "poll", None, "c_planned", lambda plan: bool(plan.batches))
    _wrap(RequestStore, "dispatch", "c_dispatch", "c_dispatched")


def _install_worker() -> None:
    from kombu.transport.redis import Channel

    from carpool.gpu_worker.runtime import WorkerRuntime

    _wrap(Channel, "_brpop_start", "w_brpop_sent", None)
    _wrap(Channel, "_brpop_read", "w_wake", None)  # runs the task inside (solo pool): mark entry only
    _wrap(WorkerRuntime, "run", "w_task", "w_task_done")
    _wrap(WorkerRuntime, "_claim", None, "w_claimed")
    _wrap(WorkerRuntime, "_forward", None, "w_ran")
    _wrap(WorkerRuntime, "_finish", "w_finish", "w_finished")


def install_producer() -> None:
    """Mark when this process's result consumer has a result message decoded in hand."""
    from carpool.celery_edge.result_consumer import PromptResultConsumer

    _wrap(PromptResultConsumer, "on_state_change", "p_result", None)


def open_trace(directory: str) -> None:
    global _fd
    _fd = os.open(os.path.join(directory, f"{os.getpid()}.trace"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)


def _install_from_env() -> None:
    import sys

    directory = os.environ.get("CARPOOL_HOPTRACE_DIR")
    if not directory:
        return
    open_trace(directory)
    argv = " ".join(sys.argv)
    if "coordinator" in argv:
        _install_coordinator()
    elif "worker" in argv:
        _install_worker()


_install_from_env()

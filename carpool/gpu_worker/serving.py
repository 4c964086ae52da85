"""What a worker serves: the tasks it runs, the batch queues it consumes, the spec of a batch's task.

``CARPOOL_SERVE_TASKS`` makes a dedicated worker (only the tasks named); otherwise a worker serves
every task registered (``carpool.infer`` and those of ``CARPOOL_IMPORTS``). ``carpool worker`` asks
:func:`batch_queues` which queues to consume; the runtime asks :func:`served_spec` per batch.
"""

from __future__ import annotations

from carpool.config import Settings
from carpool.errors import ConfigError
from carpool.registry import TaskSpec, batch_queue_of, check_batch_queue, import_task_modules, registered


def served_tasks(serve: tuple[str, ...], specs: dict[str, TaskSpec]) -> frozenset[str]:
    """The tasks a worker runs: those named (a dedicated worker), else every task (``carpool.infer``
    and those of ``CARPOOL_IMPORTS``)."""
    if not serve:
        return frozenset(specs)
    unknown = sorted(set(serve) - set(specs))
    if unknown:
        raise ConfigError(
            f"CARPOOL_SERVE_TASKS names {', '.join(unknown)}, which no module in CARPOOL_IMPORTS defines "
            f"(known: {', '.join(sorted(specs))})"
        )
    return frozenset(serve)


def batch_queues(settings: Settings) -> list[str]:
    """The batch queues a worker with ``settings`` consumes: those of the tasks it serves."""
    import_task_modules(settings.imports)
    specs = registered()
    queues = []
    for task in sorted(served_tasks(settings.serve_tasks, specs)):
        check_batch_queue(specs[task], settings)
        queue = batch_queue_of(specs[task], settings)
        if queue not in queues:
            queues.append(queue)
    return queues


def served_spec(specs: dict[str, TaskSpec], served: frozenset[str], task: str) -> TaskSpec:
    """The spec of ``task`` among a worker's ``specs``; a batch of a task it does not serve fails
    with what to change."""
    spec = specs.get(task)
    if spec is None:
        if task in registered():  # imported here, left out by CARPOOL_SERVE_TASKS
            raise LookupError(
                f"this worker does not serve {task!r} (CARPOOL_SERVE_TASKS / --tasks names only "
                f"{', '.join(sorted(served))}); add it there, or route its batches to workers that serve it "
                "(@batched(batch_queue=...))"
            )
        raise LookupError(
            f"this worker does not serve {task!r} (serves {', '.join(sorted(served))}); "
            "add its module to CARPOOL_IMPORTS here, or route its batches to workers that serve it "
            "(@batched(batch_queue=...))"
        )
    return spec


def unserved_neighbours(settings: Settings, specs: dict[str, TaskSpec], served: frozenset[str]) -> list[str]:
    """What to warn of at a worker's start: each task it imports and does not serve whose batches go
    to a batch queue it consumes (it would take them and fail them)."""
    consumed = {batch_queue_of(spec, settings) for name, spec in specs.items() if name in served}
    return [
        f"this worker consumes batch queue {batch_queue_of(spec, settings)} but does not serve {name}, whose"
        " batches go there"
        f" too: it fails them (ModelError); serve it here too (CARPOOL_SERVE_TASKS / --tasks), or give it"
        " a batch queue of its own (@batched(batch_queue=...))"
        for name, spec in sorted(specs.items())
        if name not in served and batch_queue_of(spec, settings) in consumed
    ]

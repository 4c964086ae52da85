"""Remote control commands a carpool worker answers otherwise than Celery's own handlers.

Celery's ``rate_limit`` and ``time_limit`` set the named task's attribute in the worker and answer
ok. For a carpool task neither can hold (batches run as fast as the device allows, to their end),
and the attribute would then refuse every callback and chain step this worker sends to that task,
as ``.delay()`` refuses a task with one. So for carpool's tasks the worker answers no, saying why,
and changes nothing; for any other task Celery's handler runs as before.
"""

from __future__ import annotations

from typing import Any

from celery.utils.log import get_logger
from celery.utils.time import rate
from celery.worker import control
from celery.worker.control import control_command, nok, ok

from carpool.celery_edge.options import UNSUPPORTED_OPTIONS, rate_limit_refusal
from carpool.names import RUN_BATCH_TASK
from carpool.registry import spec_for

log = get_logger(__name__)

_celery_rate_limit = control.Panel.data["rate_limit"]
_celery_time_limit = control.Panel.data["time_limit"]


def is_carpool_task(name: Any) -> bool:
    """Whether ``name`` is one of carpool's tasks: ``carpool.infer``, a ``@batched`` task, or the
    batch task itself."""
    return name == RUN_BATCH_TASK or (isinstance(name, str) and spec_for(name) is not None)


@control_command(  # type: ignore[untyped-decorator]
    args=[("task_name", str), ("rate_limit", str)],
    signature="<task_name> <rate_limit (e.g., 5/s | 5/m | 5/h)>",
)
def rate_limit(state: Any, task_name: Any, rate_limit: Any, **kwargs: Any) -> Any:
    """Tell worker(s) to modify the rate limit for a task by type (refused for carpool's tasks)."""
    if is_carpool_task(task_name):
        if _no_limit(rate_limit):  # none to unset: carpool's tasks never have one
            return ok("rate limit disabled successfully")
        log.warning("rate limit for %s refused: carpool's tasks have none", task_name)
        return nok(f"{task_name}: {rate_limit_refusal(rate_limit)}")
    return _celery_rate_limit(state, task_name, rate_limit, **kwargs)


def _no_limit(rate_limit: Any) -> bool:
    """Whether ``rate_limit`` is no limit, as Celery reads it (None, 0, "0", "0/s"...)."""
    try:
        return not rate_limit or rate(rate_limit) == 0
    except (TypeError, ValueError):  # not a rate at all: refused as any other
        return False


@control_command(  # type: ignore[untyped-decorator]
    args=[("task_name", str), ("soft", float), ("hard", float)],
    signature="<task_name> <soft_secs> [hard_secs]",
)
def time_limit(state: Any, task_name: Any = None, hard: Any = None, soft: Any = None, **kwargs: Any) -> Any:
    """Tell worker(s) to modify the time limit for task by type (refused for carpool's tasks)."""
    if is_carpool_task(task_name):
        if not hard and not soft:  # none to unset: carpool's tasks never have one
            return ok("time limits set successfully")
        log.warning("time limits for %s refused: carpool's tasks have none", task_name)
        why = UNSUPPORTED_OPTIONS["time_limit"]
        return nok(f"{task_name}: time limits are not supported by carpool tasks: {why}")
    return _celery_time_limit(state, task_name, hard=hard, soft=soft, **kwargs)

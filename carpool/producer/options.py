"""Which ``apply_async`` options a carpool task honours, and a clear refusal for the rest.

A carpool request is run by a batch worker, not by Celery's tracer, so options that only the tracer
or a worker's scheduler would act on would be dropped without a word. Each is refused at the call
instead, with what to do about it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from carpool.errors import UnsupportedOption

_WHY: Final[Mapping[str, str]] = {
    "countdown": "the coordinator batches a request as soon as it arrives; send it later from your code",
    "eta": "the coordinator batches a request as soon as it arrives; send it later from your code",
    "link": (
        "callbacks are run by Celery's tracer, which batch workers bypass; call the next step with "
        "the result of .get() (or gather) in your code"
    ),
    "link_error": (
        "error callbacks are run by Celery's tracer, which batch workers bypass; catch the exception "
        "that .get() raises"
    ),
    "chain": (
        "a chain's next step is run by Celery's tracer, which batch workers bypass; call the next step "
        "with the result of .get() in your code"
    ),
    "chord": "a chord's callback is run by Celery's tracer, which batch workers bypass; use gather()",
    "time_limit": "batch workers run a batch to its end; bound the wait with .get(timeout=...) instead",
    "soft_time_limit": "batch workers run a batch to its end; bound the wait with .get(timeout=...) instead",
    "ignore_result": "every request's result is stored: it is how the batch answers each caller",
}
_JSON_ONLY: Final = ("serializer", "compression")


def check_options(task_name: str, options: Mapping[str, Any]) -> None:
    """Raise :class:`~carpool.errors.UnsupportedOption` for the first option carpool cannot honour."""
    for name, value in options.items():
        why = _WHY.get(name)
        if why is not None and value not in (None, False, [], ()):
            raise UnsupportedOption(f"{task_name}: {name}= is not supported by carpool tasks: {why}")
        if name in _JSON_ONLY and value not in (None, "json"):
            raise UnsupportedOption(
                f"{task_name}: {name}={value!r} is not supported: carpool requests are plain JSON; "
                f"drop {name}="
            )

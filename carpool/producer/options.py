"""Which ``apply_async`` options a carpool task honours, and a clear refusal for the rest.

A carpool request is run by a batch worker, not by Celery's tracer. What the tracer or a worker's
scheduler would do for the others, carpool does itself: ``countdown`` / ``eta`` (the coordinator
holds the request until then), ``link`` / ``link_error`` and chains (the process that stores the
result applies them, :mod:`carpool.celery_edge.links`), ``expires``, ``priority``, and ``revoke()``.
Options it cannot honour would be dropped without a word; each is refused at the call instead, with
what to do about it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from carpool.errors import UnsupportedOption

_WHY: Final[Mapping[str, str]] = {
    "chord": (
        "a chord's body waits on a counter that Celery's tracer advances per header task, which batch "
        "workers do not run; gather() the header's results and call the body with them"
    ),
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

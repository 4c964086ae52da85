"""Which ``apply_async`` options a carpool task honours, and a clear refusal for the rest.

A carpool request is run by a batch worker, not by Celery's tracer. What the tracer or a worker's
scheduler would do for the others, carpool does itself: ``countdown`` / ``eta`` (the coordinator
holds the request until then), ``link`` / ``link_error`` and chains (the process that stores the
result applies them, :mod:`carpool.celery_edge.links`), ``expires``, ``priority``, and ``revoke()``.
Options it cannot honour would be dropped without a word; each is refused at the call instead, with
what to do about it. The signatures in ``link`` / ``link_error`` / ``chain`` are checked the same way
(each carpool step's own options, a chord with a carpool task in its header): one that failed
only when the worker applied it would fail later than the call. A step naming a task this process
does not import is left to the process that applies it, which may know it; one that no process
sending it knows goes, with no queue of its own, to the request queue (the app's default queue),
where the coordinators batch it (their ``CARPOOL_IMPORTS``) or answer it with an error."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

from carpool.errors import ConfigError, UnsupportedOption
from carpool.names import NOT_SENDABLE, RUN_BATCH_TASK
from carpool.redis_edge.keys import PRIORITY_SEP, PRIORITY_STEPS
from carpool.registry import spec_for

if TYPE_CHECKING:
    from celery import Celery

# Why each option that batch workers cannot honour is refused: at the call, and at intake when
# another app sent it.
UNSUPPORTED_OPTIONS: Final[Mapping[str, str]] = {
    "chord": (
        "a chord's body waits on a counter that Celery's tracer advances per header task, which batch "
        "workers do not run; gather() the header's results and call the body with them"
    ),
    "time_limit": "batch workers run a batch to its end; bound the wait with .get(timeout=...) instead",
    "soft_time_limit": "batch workers run a batch to its end; bound the wait with .get(timeout=...) instead",
    "ignore_result": "every request's result is stored: it is how the batch answers each caller",
}
_JSON_ONLY: Final = ("serializer", "compression")
# The options holding signatures that the process storing the result applies after it.
_LINKS: Final = frozenset({"link", "link_error", "chain"})
CHORD_TASK: Final = "celery.chord"
_NESTING: Final = frozenset({"celery.group", "celery.chain"})  # their kwargs["tasks"] are signatures


def check_send_settings(task_name: str, app: Celery, task: Any = None) -> None:
    """Raise :class:`~carpool.errors.UnsupportedOption` for an app setting (or ``task``'s own
    attribute) that Celery's ``apply_async`` would add to every call, and carpool cannot honour:
    a call's own option is refused by :func:`check_options`, and the setting must not do quietly
    what the option may not (a compressed or pickled request is unreadable to the coordinators)."""
    conf = app.conf
    serializer = getattr(task, "serializer", None) or conf.task_serializer
    if serializer not in (None, "json"):
        raise UnsupportedOption(
            f"{task_name}: task_serializer={serializer!r} is not supported by carpool tasks: requests"
            " are plain JSON; set task_serializer='json' on this app"
        )
    compression = getattr(task, "compression", None) or conf.task_compression
    if compression:
        raise UnsupportedOption(
            f"{task_name}: task_compression={compression!r} is not supported by carpool tasks: requests"
            " are plain JSON; unset task_compression on this app"
        )
    ignore = getattr(task, "ignore_result", None)
    if ignore if ignore is not None else conf.task_ignore_result:
        raise UnsupportedOption(
            f"{task_name}: task_ignore_result=True is not supported by carpool tasks: "
            f"{UNSUPPORTED_OPTIONS['ignore_result']}; set it False for this app"
        )
    rate = getattr(task, "rate_limit", None)
    if rate:
        raise UnsupportedOption(f"{task_name}: {rate_limit_refusal(rate)}")
    limit = _time_limit_refusal(task, app)
    if limit:
        raise UnsupportedOption(f"{task_name}: {limit}")
    check_priority_lists(task_name, app)


# The publishing options a task's attributes may set that carpool's send would otherwise not see:
# the others Celery merges are checked where they are read (serializer, compression, time limits:
# :func:`check_send_settings`) or added by the send itself (priority). Celery sets ``serializer`` on
# every task, so merging it would send every call down Celery's slower path for nothing.
_TASK_PUBLISH_OPTIONS: Final = (
    "queue",
    "expires",
    "routing_key",
    "exchange",
    "delivery_mode",
    "immediate",
    "mandatory",
)


def with_task_options(task: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` over the publishing options ``task``'s own attributes set (its class, or
    ``task_annotations``: ``queue``, ``expires``, ``routing_key``...), as Celery's ``apply_async``
    merges them into every call; an attribute left None sets nothing."""
    getter = getattr(task, "_get_exec_options", None)
    if getter is None:
        return options
    exec_options = getter()
    own = {
        key: value
        for key in _TASK_PUBLISH_OPTIONS
        if (value := exec_options.get(key)) is not None and key not in options
    }
    return {**own, **options} if own else options


def check_priority_lists(task_name: str, app: Celery) -> None:
    """Refuse a ``broker_transport_options`` that would push prioritised requests to lists the
    coordinators never read: they drain kombu's default priority steps, with its separator."""
    transport = app.conf.broker_transport_options or {}
    steps = transport.get("priority_steps")
    if steps is not None and list(steps) != list(PRIORITY_STEPS):
        raise UnsupportedOption(
            f"{task_name}: broker_transport_options priority_steps={list(steps)!r} is not supported by"
            f" carpool tasks: the coordinators drain the request lists of kombu's default steps"
            f" {list(PRIORITY_STEPS)} (priorities 0-9 still order requests, in those steps); remove it"
            " from this app's broker_transport_options"
        )
    sep = transport.get("sep")
    if sep is not None and sep != PRIORITY_SEP:
        raise UnsupportedOption(
            f"{task_name}: broker_transport_options sep={sep!r} is not supported by carpool tasks: the"
            " coordinators drain the request lists named with kombu's default separator; remove it"
            " from this app's broker_transport_options"
        )


def _time_limit_refusal(task: Any, app: Celery) -> str | None:
    """Why a time limit the task (its class, ``task_annotations``) or the app's settings give every
    call cannot hold, or None: Celery's worker enforces them, whatever the message says."""
    for option in ("time_limit", "soft_time_limit"):
        limit = getattr(task, option, None) or app.conf.get(f"task_{option}")
        if limit:
            return (
                f"{option}={limit!r} (the task's, task_annotations' or task_{option}) is not supported"
                f" by carpool tasks: {UNSUPPORTED_OPTIONS[option]}; unset it for carpool's tasks"
            )
    return None


def rate_limit_refusal(rate: Any) -> str:
    return (
        f"rate_limit={rate!r} is not supported by carpool tasks: Celery's worker would space each"
        " task out, and carpool runs them in batches as fast as the device allows; bound the"
        " batches with max_batch (CARPOOL_MAX_BATCH) and unset rate_limit (task_annotations too)"
    )


def check_options(task_name: str, options: Mapping[str, Any], app: Celery) -> None:
    """Raise :class:`~carpool.errors.UnsupportedOption` for the first option carpool cannot honour,
    in ``options`` or in a signature its ``link`` / ``link_error`` / ``chain`` holds."""
    for name, value in options.items():
        why = UNSUPPORTED_OPTIONS.get(name)
        if why is not None and value not in (None, False, [], ()):
            raise UnsupportedOption(f"{task_name}: {name}= is not supported by carpool tasks: {why}")
        if name in _JSON_ONLY and value not in (None, "json"):
            raise UnsupportedOption(
                f"{task_name}: {name}={value!r} is not supported: carpool requests are plain JSON; "
                f"drop {name}="
            )
        if name in _LINKS and value:
            for signature in _signatures(value):
                check_step(app, f"{task_name}: its {name}= step", signature)


def _signatures(value: Any) -> Iterable[Any]:
    """The signatures of a ``link`` / ``link_error`` / ``chain`` value: one, or a list of them."""
    return (value,) if isinstance(value, Mapping) else value


def check_step(app: Celery, where: str, step: Any) -> None:
    """Refuse ``step`` (a signature, as a dict) if carpool could not apply it as Celery would."""
    if isinstance(step, list | tuple):  # a chord's header before it is frozen into a group
        for member in step:
            check_step(app, where, member)
        return
    if not isinstance(step, Mapping):
        return  # not a signature: Celery itself refuses it when the step is sent
    task = step.get("task")
    options = step.get("options") or {}
    kwargs = step.get("kwargs") or {}
    if task == RUN_BATCH_TASK:
        raise UnsupportedOption(f"{where}: {NOT_SENDABLE}")
    for name in ("link", "link_error"):  # a step's own links, which its worker's tracer sends
        for nested in _signatures(options.get(name) or ()):
            check_step(app, where, nested)
    if task == CHORD_TASK:
        header = kwargs.get("header")
        carpool = next(_carpool_tasks(header), None)
        if carpool is not None:
            raise UnsupportedOption(
                f"{where} is a chord (in a chain, Celery makes a group followed by a task one) whose "
                f"header runs {carpool}, a carpool task: {UNSUPPORTED_OPTIONS['chord']}"
            )
        check_step(app, where, header)
        check_step(app, where, kwargs.get("body"))
    elif task in _NESTING:
        for member in kwargs.get("tasks") or ():
            check_step(app, where, member)
    elif isinstance(task, str) and spec_for(task) is not None:
        # A carpool step is sent through BatchedTask.apply_async, which would refuse these options
        # only once the step's turn came, leaving its result waiting.
        check_options(f"{where} {task}", options, app)
    # Any other step is a plain Celery task's, whose worker honours its options, or a task this
    # process does not import: sent with no queue of its own, it goes to the request queue, whose
    # coordinators batch it (their CARPOOL_IMPORTS) or answer it with an error under its id.


def _carpool_tasks(step: Any) -> Iterator[str]:
    """The names of the carpool tasks in ``step`` and the groups, chains and chords it nests."""
    if isinstance(step, list | tuple):  # a chord's header before it is frozen into a group
        for member in step:
            yield from _carpool_tasks(member)
        return
    if not isinstance(step, Mapping):
        return
    task = step.get("task")
    kwargs = step.get("kwargs") or {}
    if task == CHORD_TASK:
        yield from _carpool_tasks(kwargs.get("header"))
        yield from _carpool_tasks(kwargs.get("body"))
    elif task in _NESTING:
        for member in kwargs.get("tasks") or ():
            yield from _carpool_tasks(member)
    elif isinstance(task, str) and spec_for(task) is not None:
        yield task


def check_app_conf(app: Celery, task_names: Iterable[str]) -> None:
    """Raise :class:`~carpool.errors.ConfigError` for the Celery settings of ``app`` the processes
    that store carpool's results (coordinators, workers) cannot honour for the carpool tasks
    ``task_names``: Celery reads them where results are stored, so that is where they are refused."""
    if app.conf.result_extended:
        raise ConfigError(
            "result_extended=True is not supported by carpool: a batch's results are stored without"
            " each request's name, args and kwargs (Flower shows them); set it False for this app"
        )
    for name in task_names:
        task = app.tasks.get(name)
        if task is not None and getattr(task, "rate_limit", None):
            raise ConfigError(f"{name}: {rate_limit_refusal(task.rate_limit)}")
        limit = _time_limit_refusal(task, app) if task is not None else None
        if limit:
            raise ConfigError(f"{name}: {limit}")
        if task is not None and task.track_started:
            raise ConfigError(
                f"{name}: track_started (task_track_started) is not supported by carpool: a request's"
                " result key holds only its answer, written once (Flower shows each request's"
                " task-started event); set it False for carpool's tasks"
            )

"""The tasks producers call: ``infer``, and ``@batched`` to make any batch function one.

    from carpool.tasks import infer
    infer.delay("text").get()

    from carpool import batched

    @batched(length=len)
    def shout(texts: list[str]) -> list[str]:      # one output per item, same order
        return [t.upper() for t in texts]

    shout.delay("hi").get()                       # "HI", computed in a batch on a worker

Importing this module imports Celery and pydantic, never torch. ``.delay()`` validates the request
before it is sent (a bad one raises :class:`~carpool.errors.InvalidInput` in the caller), refuses
Celery options a batch worker could not honour (:mod:`carpool.celery_edge.options`) and stamps the send
time, so the coordinator measures waiting from the request's real arrival.
"""

from __future__ import annotations

import inspect
import keyword
import logging
import numbers
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

from celery import Task
from celery.result import AsyncResult
from redis.exceptions import RedisError

from carpool.celery_edge.app import app, settings_of, state_of
from carpool.celery_edge.options import check_options, check_send_settings, with_task_options
from carpool.models.task import InferSpec
from carpool.names import INFER_TASK, RUN_BATCH_TASK, SENT_AT_HEADER
from carpool.producer.submit import publish_tasks
from carpool.redis_edge.replication import fence, not_replicated
from carpool.registry import BatchedSpec, BatchFunction, LengthFunction, TaskSpec, register

log = logging.getLogger(__name__)


# apply_async options the direct publish handles exactly as Celery would; any other goes through Celery.
_DIRECT_OPTIONS = frozenset({"priority", "expires", "queue"})


class BatchedTask(Task):  # type: ignore[misc]  # Celery is untyped
    """A task whose requests a coordinator batches (``infer`` and every ``@batched`` function):
    validated at the producer by its :class:`~carpool.registry.TaskSpec`, published cheaply.

    The message is the one Celery would send (built by
    :class:`carpool.celery_edge.task_messages.TaskMessageBuilder` from Celery's own
    ``create_task_message``), published with its task-sent event in one MULTI/EXEC on a kept Redis
    client: one round trip instead of kombu's two, each of which also builds a new ``redis.Redis``.
    Calls with other options (``countdown``, ``link``, ``task_id``...), eager mode, calls from inside
    a task (parent and root ids), or a failed direct publish (then Celery's publish retry policy
    applies) take Celery's own path.
    """

    spec: TaskSpec

    def validate(self, args: Any, kwargs: Any) -> None:
        """Raise :class:`~carpool.errors.InvalidInput` unless ``(args, kwargs)`` is a valid request."""
        self.spec.accept(args, kwargs, settings_of(self.app))

    def apply(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        """Run here, as Celery's ``apply`` does, after the checks ``.delay()`` makes, on the
        arguments as a worker gets them: decoded from the JSON they travel as (lists for tuples),
        the caller's own objects left alone, as Celery's eager ``apply_async`` passes them."""
        self.validate(args, kwargs)
        from kombu import serialization

        content_type, encoding, data = serialization.dumps((args or (), kwargs or {}), "json")  # type: ignore[no-untyped-call]  # kombu is untyped
        args, kwargs = serialization.loads(data, content_type, encoding, accept=[content_type])  # type: ignore[no-untyped-call]
        return super().apply(args, kwargs, **options)

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> AsyncResult:
        self.validate(args, kwargs)
        check_send_settings(self.name, self.app, self)
        options = with_task_options(self, options)
        check_options(self.name, options, self.app)
        if self.priority and options.get("priority") is None:  # task_default_priority, as Celery adds it
            options["priority"] = self.priority
        # The coordinators drain the request queue, whatever the app's default queue is (or the
        # queue the application's own routes name for this task).
        if "queue" not in options:
            options["queue"] = state_of(self.app).request_queue(self.name, args, kwargs)
        headers = dict(options.pop("headers", None) or {})
        headers.setdefault(SENT_AT_HEADER, time.time())
        if (
            options.keys() <= _DIRECT_OPTIONS
            and not self.app.conf.task_always_eager
            and self.app.current_worker_task is None
        ):
            try:
                (result,) = publish_tasks(
                    self.name, [(args or (), kwargs or {})], app=self.app, headers=headers, **options
                )
                return result
            except RedisError as exc:
                log.info("direct publish failed (%s); sending through Celery, with its retries", exc)
        result = super().apply_async(args, kwargs, headers=headers, **options)
        settings = settings_of(self.app)
        if settings.wait_replicas and not self.app.conf.task_always_eager:
            _replicated(self.app, result, settings.wait_replicas, settings.wait_timeout_s)
        return result


def _replicated(app: Any, result: AsyncResult, replicas: int, timeout_s: float) -> None:
    """Raise :class:`~carpool.errors.NotReplicated` unless ``replicas`` replicas have the message
    Celery just published (on a kombu connection of its own: a WAIT after a write of ours covers it)."""
    try:
        state = state_of(app)
        with state.publishing():
            acked = fence(state.publisher(), replicas, timeout_s)
    except RedisError as exc:
        error = not_replicated(f"request {result.id} ({exc})", 0, replicas, timeout_s)
    else:
        if acked >= replicas:
            return
        error = not_replicated(f"request {result.id}", acked, replicas, timeout_s)
    error.results = [result]
    raise error


# The built-in text models: one task of the mechanism @batched uses, registered like any other.
_INFER_SPEC = InferSpec(INFER_TASK)
register(_INFER_SPEC)


@app.task(base=BatchedTask, name=INFER_TASK, bind=False, spec=_INFER_SPEC)  # type: ignore[untyped-decorator]
def infer(text: str, model: str | None = None) -> Any:
    """Embed/run ``text`` on ``model`` (default: ``CARPOOL_MODEL``).

    Normally the coordinator takes these messages and a GPU worker runs them in batches; this body
    runs only when a plain Celery worker consumes the request queue (the one-task-per-request
    baseline that ``carpool bench`` compares against).
    """
    from carpool.gpu_worker.runner import pick_device, run_single

    settings = settings_of(app)
    return run_single(model or settings.model, text, pick_device(settings.device), settings.autocast_bf16)


@overload
def batched(
    fn: BatchFunction,
    *,
    length: LengthFunction | None = None,
    name: str | None = None,
    max_batch: int | None = None,
    max_tokens: int | None = None,
    bins: Sequence[int] | Literal["auto"] | None = None,
    batch_queue: str | None = None,
) -> BatchedTask: ...


@overload
def batched(
    fn: None = None,
    *,
    length: LengthFunction | None = None,
    name: str | None = None,
    max_batch: int | None = None,
    max_tokens: int | None = None,
    bins: Sequence[int] | Literal["auto"] | None = None,
    batch_queue: str | None = None,
) -> Callable[[BatchFunction], BatchedTask]: ...


def batched(
    fn: BatchFunction | None = None,
    *,
    length: LengthFunction | None = None,
    name: str | None = None,
    max_batch: int | None = None,
    max_tokens: int | None = None,
    bins: Sequence[int] | Literal["auto"] | None = None,
    batch_queue: str | None = None,
) -> BatchedTask | Callable[[BatchFunction], BatchedTask]:
    """Make ``fn(items) -> outputs`` (one output per item, same order) a Celery task that carpool batches.

    ``f.delay(item)`` sends one request (any JSON value); ``.get()`` returns ``fn``'s output for it.
    ``length(item) -> int`` (run on the coordinator; ``len`` by default) bins requests so each batch
    holds items of similar size; ``max_batch``, ``max_tokens`` (count x longest length) and ``bins``
    (increasing length edges, or ``"auto"``) override the deployment's settings for this task.
    ``name`` defaults to ``module.function``, as Celery names tasks. ``batch_queue`` sends this task's
    batches to their own queue, for workers dedicated to it (``carpool worker --tasks NAME``).
    ``fn`` runs only on workers; give it (or the object it is) a ``load(device)`` to build heavy state
    once per worker process before the first batch.
    """

    def wrap(function: BatchFunction) -> BatchedTask:
        if name is not None and (not isinstance(name, str) or not name.strip()):
            raise TypeError(f"@batched(name=...) must be a non-empty string (a task name), not {name!r}")
        task_name = name or _default_name(function)
        _check_name(task_name)
        _check_signature(task_name, function)
        if _is_async(function):
            raise TypeError(
                f"@batched takes a synchronous function, and {task_name} is async (workers call it with"
                " no event loop running); wrap it: def f(items): return asyncio.run(your_function(items))"
            )
        length_fn = length if length is not None else getattr(function, "length", len)
        spec = BatchedSpec(
            name=task_name,
            fn=function,
            length=length_fn,
            max_batch=max_batch,
            max_tokens=max_tokens,
            bin_edges=_edges(bins),
            batch_queue=batch_queue,
        )
        register(spec)

        def run(item: Any) -> Any:
            # Eager mode (task_always_eager, .apply()) and a plain Celery worker on the request queue
            # run one item at a time, under the contract batch workers keep.
            return _run_alone(spec, item)

        # Celery compiles a function of this name to check call signatures: it must be an identifier.
        short = task_name.rpartition(".")[2]
        run.__name__ = short if short.isidentifier() and not keyword.iskeyword(short) else "batched_task"
        run.__doc__ = getattr(function, "__doc__", None)
        task: BatchedTask = app.task(base=BatchedTask, name=task_name, bind=False, spec=spec)(run)
        return task

    if fn is not None:
        return wrap(fn)
    return wrap


def _edges(bins: Any) -> Any:
    """``bins`` as the spec reads them: "auto", None, or a tuple of whole numbers (a list, range or
    numpy array of them included); anything else is left for the spec to refuse, naming it."""
    if bins is None or isinstance(bins, str | bytes):
        return bins
    try:
        edges = tuple(bins)
    except TypeError:
        return bins
    return tuple(int(e) if isinstance(e, numbers.Integral) and not isinstance(e, bool) else e for e in edges)


def _check_name(task_name: str) -> None:
    """Refuse a name that carpool's or Celery's own tasks hold, where every process would find
    two tasks under it (a worker refuses to start; a coordinator would batch its requests)."""
    if task_name == RUN_BATCH_TASK or task_name.startswith("celery."):
        owner = "carpool's worker task's" if task_name == RUN_BATCH_TASK else "in Celery's own namespace"
        raise ValueError(
            f"@batched(name={task_name!r}): the name is {owner}; name your task in a namespace of"
            " your own (e.g. 'myapp.embed')"
        )


def _check_signature(task_name: str, function: Any) -> None:
    """Refuse, at decoration, a function that a batch's list of items cannot be passed to alone:
    every request of it would fail on the worker (a method decorated in its class body, say, gets
    the list as ``self``). A decorator's wrapper (functools.wraps) is judged by its own signature,
    which may differ from the function it wraps, unless it takes anything (``*args, **kwargs``):
    then by the function it passes them to."""
    for follow in (False, True):
        try:
            signature = inspect.signature(function, follow_wrapped=follow)
        except (TypeError, ValueError):  # a builtin or an extension's callable: not inspectable
            return
        try:
            signature.bind([])
        except TypeError as exc:
            params = signature.parameters.values()
            shown = ", ".join(str(p.replace(annotation=p.empty)) for p in params)
            in_class = shown.startswith("self")
            method = " (a method decorated in its class body gets no instance)" if in_class else ""
            raise TypeError(
                f"@batched calls {task_name} with one argument, the batch's list of items, and it takes"
                f" ({shown}){method}: {exc}; decorate a function of that one argument, or a bound method"
                " (batched(Service().method, name=...))"
            ) from None
        kinds = {p.kind for p in signature.parameters.values()}
        if not kinds <= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}:
            return  # a signature of its own: what workers call takes the list


def _is_async(function: Any) -> bool:
    call = getattr(function, "__call__", None)  # noqa: B004  # an object's own __call__, as adapters have
    return any(
        inspect.iscoroutinefunction(f) or inspect.isasyncgenfunction(f)
        for f in (function, call)
        if f is not None
    )


_LOADED: set[tuple[int, str]] = set()  # (pid, task name): the functions whose load() ran in this process


def _run_alone(spec: BatchedSpec, item: Any) -> Any:
    """``spec``'s function on one item, as a batch worker runs it: ``load(device)`` first (once per
    process), one output per item, an output JSON carries unchanged (else a
    :class:`~carpool.errors.ModelError`, as a batched request's caller gets it); what the function
    raises propagates as raised."""
    from carpool.codec import read_back, storable
    from carpool.errors import InvalidInput, ModelError, described, stops_the_process, user_failure
    from carpool.gpu_worker.runner import OutputCountMismatch, one_per_item, pick_device

    [length] = spec.measured([item])  # what the coordinator would refuse the request for
    if isinstance(length, InvalidInput):
        raise length
    settings = settings_of(app)
    loaded = (os.getpid(), spec.name)
    if loaded not in _LOADED and callable(getattr(spec.fn, "load", None)):
        spec.load(pick_device(settings.device), settings)
    _LOADED.add(loaded)
    try:
        (out,) = one_per_item(spec.fn([item]), 1)
    except OutputCountMismatch as exc:
        raise ModelError(described(exc)) from None
    except BaseException as raised:  # sys.exit() or CancelledError: its item's failure, as on a worker
        if isinstance(raised, Exception) or stops_the_process(raised):
            raise  # an Exception propagates as raised, as Celery's eager apply stores it
        raise user_failure(raised) from None
    [(ok, value)] = storable(spec.name, [(True, out)], settings.result_serializer)
    if not ok:
        raise ModelError(described(value))
    # As .get() reads a worker's result back, so a test suite in eager mode sees the types it will.
    return read_back(value, settings.result_serializer)


def _default_name(function: Any) -> str:
    module = getattr(function, "__module__", None)
    qualname = getattr(function, "__qualname__", None) or getattr(function, "__name__", None)
    if not module or not qualname or "<" in qualname:
        raise TypeError(f"@batched cannot name {function!r} as module.function; pass name='your.task.name'")
    return f"{module}.{qualname}"


__all__ = ["BatchedTask", "batched", "infer"]

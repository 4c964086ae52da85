"""Batched tasks by name: how a request is validated, measured and routed, and what a worker runs.

Every task a coordinator batches is a :class:`TaskSpec`: ``carpool.infer`` (the built-in text
models, :mod:`carpool.models.task`) and each ``@carpool.batched`` function (:class:`BatchedSpec`).
A spec has three halves, one per process: ``accept`` validates one call (producer and coordinator),
``prepare`` measures one take's values of one routing key in one call (coordinator), ``load`` and
``batch_function`` build and run the work (worker). ``carpool.tasks`` registers ``carpool.infer``;
``@carpool.batched`` fills the registry when a task module is imported. Nothing here loads a model.
"""

from __future__ import annotations

import importlib
import logging
import numbers
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple

from carpool.errors import ConfigError, InvalidInput, described, stops_the_process
from carpool.names import MAX_BATCH_LIMIT
from carpool.validation import bind_item, checked_length, validate_item

if TYPE_CHECKING:
    from carpool.config import Settings

log = logging.getLogger(__name__)

BatchFunction = Callable[[list[Any]], Sequence[Any]]
LengthFunction = Callable[[Any], int]
#: A worker's batch: (the requests' travelling items, their lengths) -> one output per item.
BatchCall = Callable[[list[Any], list[int]], Sequence[Any]]
#: A batch started on an asynchronous device: (items, lengths) -> a function waiting for its outputs.
LaunchCall = Callable[[list[Any], list[int]], Callable[[], Sequence[Any]]]

#: The module that registers the built-in ``carpool.infer``; every coordinator and worker imports it.
BUILTIN_TASK_MODULE = "carpool.tasks"


class Prepared(NamedTuple):
    """What a task's coordinator half made of one group of values, position by position."""

    lengths: list[int | InvalidInput]  # each value's length, or why its request is refused
    items: Sequence[Any]  # what travels to the worker in each request's slot (unused where refused)


@dataclass(frozen=True, slots=True)
class TaskSpec(ABC):
    """One task the coordinator batches, with its own batching limits.

    ``None`` limits fall back to the deployment's settings (``CARPOOL_MAX_BATCH``, ...). Requests are
    batched per routing key (``accept`` names it): two keys never share a batch, and the key is the
    policy's queue, the latency model's and the metrics' ``model`` label.
    """

    name: str
    _: KW_ONLY
    max_batch: int | None = None
    max_tokens: int | None = None
    bin_edges: tuple[int, ...] | Literal["auto"] | None = None
    batch_queue: str | None = None  # None: the deployment's batch queue

    #: whether workers check that each output travels as JSON unchanged before storing it
    checks_outputs: ClassVar[bool] = True
    #: whether an exception the batch function raises is stored as raised (as Celery stores a
    #: task's), rather than as a ModelError naming it
    raises_as_raised: ClassVar[bool] = True
    #: whether the batch function may change its items (user code may): a batch that fails is then
    #: split from a copy of its items taken before the call, not from what the call left of them
    may_change_items: ClassVar[bool] = True
    #: whether workers run the batch function under ``torch.inference_mode()``: a model's forward,
    #: not a user's function, which runs as called directly or by Celery (it may need autograd)
    inference_mode: ClassVar[bool] = False

    def __post_init__(self) -> None:
        for field, value in (("max_batch", self.max_batch), ("max_tokens", self.max_tokens)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(
                    f"batched task {self.name!r}: {field} must be an integer >= 1, not {value!r}"
                )
        if self.max_batch is not None and self.max_batch > MAX_BATCH_LIMIT:
            raise ValueError(
                f"batched task {self.name!r}: max_batch must be <= {MAX_BATCH_LIMIT}, as CARPOOL_MAX_BATCH"
                f" must, not {self.max_batch!r}"
            )
        if self.max_tokens is not None and self.max_tokens < self.pad_multiple:
            raise ValueError(
                f"batched task {self.name!r}: max_tokens must be >= {self.pad_multiple} (batches pad"
                f" lengths to multiples of {self.pad_multiple}), not {self.max_tokens!r}"
            )
        edges = self.bin_edges
        if edges is not None and edges != "auto" and not _increasing_positive(edges):
            raise ValueError(
                f"batched task {self.name!r}: bins must be 'auto' or increasing positive integers, "
                f"not {edges!r}"
            )

    @property
    def pad_multiple(self) -> int:
        """What a batch's lengths are rounded up to in its cost (``max_tokens``): the multiple its
        worker pads to; 1 where nothing is padded (a @batched function gets its items as sent)."""
        return 1

    def keys(self, settings: Settings) -> tuple[str, ...]:
        """Every routing key ``accept`` can give under ``settings``."""
        return (self.name,)

    @abstractmethod
    def accept(self, args: Any, kwargs: Any, settings: Settings) -> tuple[str, Any]:
        """(routing key, value) of one call, or raise :class:`~carpool.errors.InvalidInput`."""

    @abstractmethod
    def prepare(self, key: str, values: list[Any], settings: Settings) -> Prepared:
        """Lengths and travelling items of the values ``accept`` gave under ``key`` (coordinator)."""

    def warm_up(self, settings: Settings) -> None:
        """Build what ``prepare`` needs before the first request waits for it (coordinator start)."""
        return None

    def load(self, device: str, settings: Settings) -> None:
        """Build the heavy state ``batch_function`` needs on ``device`` (worker start, after any fork)."""
        return None

    @abstractmethod
    def batch_function(self, key: str, device: str, settings: Settings) -> BatchCall:
        """What a worker runs for one batch of ``key`` (worker)."""

    def launch_function(self, key: str, device: str, settings: Settings) -> LaunchCall | None:
        """How a worker starts a batch of ``key`` without waiting for it, where the device runs
        asynchronously (then the worker queues the next batch on the device before collecting this
        one's outputs); None: ``batch_function`` computes synchronously."""
        return None


@dataclass(frozen=True, slots=True)
class BatchedSpec(TaskSpec):
    """A ``@batched`` function: its item is its value and travels as is; ``length`` measures it."""

    fn: BatchFunction
    length: LengthFunction

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"batched task {self.name!r}: the batch function must be callable")
        if not callable(self.length):
            raise TypeError(
                f"batched task {self.name!r}: length= must be a function item -> int "
                "(e.g. length=len for texts)"
            )
        _ = self.pad_multiple  # refused here, at decoration, rather than by every coordinator at start
        TaskSpec.__post_init__(self)

    @property
    def pad_multiple(self) -> int:
        """The batch function's own ``pad_multiple`` where it pads its batch (the reranker and
        classifier adapters pad to multiples of 8), else 1."""
        multiple = getattr(self.fn, "pad_multiple", 1)
        if not isinstance(multiple, numbers.Integral) or isinstance(multiple, bool) or multiple < 1:
            raise ValueError(
                f"batched task {self.name!r}: the batch function's pad_multiple must be an integer >= 1"
                f" (the multiple it pads its batch to), not {multiple!r}"
            )
        return int(multiple)

    def accept(self, args: Any, kwargs: Any, settings: Settings) -> tuple[str, Any]:
        item = bind_item(self.name, args, kwargs)
        validate_item(self.name, item, settings)
        return self.name, item

    def prepare(self, key: str, values: list[Any], settings: Settings) -> Prepared:
        return Prepared(self.measured(values), values)

    def lengths(self, items: Sequence[Any]) -> list[int]:
        """``length`` of each item; uses the function's batch form (``.lengths``) when it has one."""
        batch_form = getattr(self.length, "__self__", None)
        many = getattr(batch_form, "lengths", None)
        if callable(many):
            return list(many(items))
        return [self.length(item) for item in items]

    def measured(self, values: list[Any]) -> list[int | InvalidInput]:
        """Each item's length, or the error its request fails with.

        The batch form (one call for all) is tried first; if it raises, each item is measured alone
        so that one bad item fails only its own request.
        """
        try:
            raw: Sequence[Any] = self.lengths(values)
            if len(raw) != len(values):
                raise ValueError(f"lengths() gave {len(raw)} values for {len(values)} items")
        except BaseException as raised:  # sys.exit() in user code fails its items, not the coordinator
            if stops_the_process(raised):
                raise
            raw = []
            for value in values:
                try:
                    raw.append(self.length(value))
                except ConfigError as exc:  # the coordinator's, not the item's
                    raw.append(
                        InvalidInput(
                            f"{self.name}: length() raised {described(exc)}; the coordinators"
                            " cannot measure items"
                        )
                    )
                except BaseException as exc:
                    if stops_the_process(exc):
                        raise
                    raw.append(InvalidInput(f"{self.name}: length() raised {described(exc)}; fix the item"))
        out: list[int | InvalidInput] = []
        for value in raw:
            if isinstance(value, InvalidInput):
                out.append(value)
                continue
            try:
                out.append(checked_length(self.name, value))
            except InvalidInput as exc:
                out.append(exc)
        return out

    def warm_up(self, settings: Settings) -> None:
        """Build what the function's own ``length`` needs when it has a ``warm_up`` (adapters do: a
        model directory missing or damaged on the coordinator raises ConfigError naming the path,
        which the coordinator logs at start; its requests are answered with that error)."""
        warm_up = getattr(self.fn, "warm_up", None)
        if callable(warm_up) and getattr(self.length, "__self__", None) is self.fn:
            warm_up()

    def load(self, device: str, settings: Settings | None = None) -> None:
        """Build the function's heavy state on ``device`` when it has a ``load`` (adapters do). An
        adapter runs under bfloat16 autocast on CUDA where ``CARPOOL_AUTOCAST_BF16`` asks; a function
        of one's own runs as it is written, which the worker's log says when the setting is on."""
        from carpool.adapters.base import Adapter

        autocast_bf16 = settings is not None and settings.autocast_bf16
        if isinstance(self.fn, Adapter):
            self.fn.load(device, autocast_bf16=autocast_bf16)
            return
        if autocast_bf16:
            log.info(
                "%s: CARPOOL_AUTOCAST_BF16 applies to carpool's models and adapters; this task's"
                " function runs at the precision it chooses (wrap its forward in torch.autocast for bf16)",
                self.name,
            )
        load = getattr(self.fn, "load", None)
        if callable(load):
            load(device)

    def batch_function(self, key: str, device: str, settings: Settings) -> BatchCall:
        fn = self.fn
        return lambda items, _lengths: fn(items)


def _increasing_positive(edges: tuple[int, ...]) -> bool:
    if not isinstance(edges, tuple):  # one number, or a string: what @batched could not read as edges
        return False
    ok = all(isinstance(e, int) and not isinstance(e, bool) and e >= 1 for e in edges)
    return ok and list(edges) == sorted(set(edges))  # () is one bin, as CARPOOL_BIN_EDGES='' is


_SPECS: dict[str, TaskSpec] = {}


def register(spec: TaskSpec) -> None:
    """Make ``spec`` known by its name; a second, different task under one name is a mistake."""
    known = _SPECS.get(spec.name)
    # A module imported twice registers its task again: the same function is no clash.
    same = known is None or (type(known) is type(spec) and getattr(known, "fn", 0) is getattr(spec, "fn", 0))
    if not same:
        raise ConfigError(
            f"two batched tasks are named {spec.name!r}; give one of them another name= in @batched"
        )
    _SPECS[spec.name] = spec


def spec_for(name: str) -> TaskSpec | None:
    return _SPECS.get(name)


def registered() -> dict[str, TaskSpec]:
    """Every batched task imported in this process, by name."""
    return dict(_SPECS)


def routing_keys(specs: Iterable[TaskSpec], settings: Settings) -> dict[str, TaskSpec]:
    """The task of each routing key; a key two tasks claim (a model named like a task) is refused."""
    out: dict[str, TaskSpec] = {}
    for spec in specs:
        check_batch_queue(spec, settings)
        for key in spec.keys(settings):
            other = out.setdefault(key, spec)
            if other is not spec:
                raise ConfigError(
                    f"{key!r} routes requests of both {other.name} and {spec.name} (a model named like "
                    "a @batched task?); rename the task (name=) or the model"
                )
    return out


def batch_queue_of(spec: TaskSpec, settings: Settings) -> str:
    """The batch queue a task's batches go to: its own, else the deployment's (CARPOOL_BATCH_QUEUE)."""
    return spec.batch_queue or settings.batch_queue


def check_batch_queue(spec: TaskSpec, settings: Settings) -> None:
    """Refuse a task whose own batch queue is the request queue: workers would take the raw requests
    off it, past the coordinators, and run them one at a time."""
    if spec.batch_queue is not None and spec.batch_queue == settings.request_queue:
        raise ConfigError(
            f"batched task {spec.name!r}: batch_queue={spec.batch_queue!r} is the request queue"
            " (CARPOOL_REQUEST_QUEUE), which the coordinators drain; give its batches a queue of their"
            " own"
        )


def import_task_modules(modules: Iterable[str]) -> list[str]:
    """Import ``carpool.tasks`` and each module (``CARPOOL_IMPORTS``) so their tasks register;
    returns the names of the tasks added."""
    before = set(_SPECS)
    importlib.import_module(BUILTIN_TASK_MODULE)
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(
                f"CARPOOL_IMPORTS names {module!r}, which cannot be imported ({exc}); "
                "make it importable on this host (installed, or on PYTHONPATH)"
            ) from exc
    added = sorted(set(_SPECS) - before)
    if added:
        log.info("batched tasks imported: %s", ", ".join(added))
    return added

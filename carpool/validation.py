"""Request validation, shared by producers (at ``.delay()``) and the coordinator (for raw messages).

Every failure is an :class:`~carpool.errors.InvalidInput` whose message names the problem and what to
change; nothing here imports torch.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any, NamedTuple

from carpool.codec import brief, crosses_as_another, dumps_exact, kombu_tags, tag_failure
from carpool.config import Settings
from carpool.errors import InputTooLong, InvalidInput, UnknownModel


class InferPayload(NamedTuple):
    """A validated ``carpool.infer`` request: :func:`validate_infer` checks each field itself (with
    an error that says what to change), so the result is a plain record, built per request."""

    text: str
    model: str


def check_call_shape(task_name: str, args: Any, kwargs: Any) -> None:
    """Raise :class:`InvalidInput` unless ``args`` is a list or tuple and ``kwargs`` a mapping (each
    may be None), as Celery's ``apply_async`` requires: a string would otherwise be taken apart
    into its characters, one argument each."""
    if args is not None and not isinstance(args, list | tuple):
        raise InvalidInput(
            f"{task_name}: args must be a list or tuple of the call's arguments, got "
            f"{type(args).__name__} ({_short(args)}); pass args as a tuple: "
            f"{_short_name(task_name)}.apply_async(({_short(args)},))"
        )
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise InvalidInput(
            f"{task_name}: kwargs must be a dict of keyword arguments, got {type(kwargs).__name__} "
            f"({_short(kwargs)}); pass a dict naming each argument (kwargs={{'name': value}}) or none"
        )


def bind_infer_args(args: Any, kwargs: Any) -> tuple[Any, Any]:
    """(text, model) from ``infer``'s call arguments, as Celery would bind them."""
    check_call_shape("carpool.infer", args, kwargs)
    args = list(args or ())
    kwargs = dict(kwargs or {})
    unknown = set(kwargs) - {"text", "model"}
    if unknown or len(args) > 2 or ("text" in kwargs and args):
        raise InvalidInput(
            f"carpool.infer takes (text, model=None); got args={_short(args)} kwargs={sorted(kwargs)}"
        )
    text = args[0] if args else kwargs.get("text", _MISSING)
    if text is _MISSING:
        raise InvalidInput("carpool.infer needs a text: call infer.delay('some text')")
    model = args[1] if len(args) > 1 else kwargs.get("model")
    return text, model


def validate_infer(text: Any, model: Any, settings: Settings) -> InferPayload:
    if not isinstance(text, str):
        raise InvalidInput(
            f"text must be a str, got {type(text).__name__} ({_short(text)}); pass the text itself, "
            "for example infer.delay(str(value))"
        )
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        bad = text[exc.start : exc.end]
        raise InvalidInput(
            f"text is not valid Unicode: {bad!r} at position {exc.start} is a lone surrogate; "
            "decode your input with errors='replace' or fix its source"
        ) from None
    if size > settings.max_input_bytes:
        raise InputTooLong(
            f"text is {size} bytes of UTF-8, over CARPOOL_MAX_INPUT_BYTES={settings.max_input_bytes}; "
            "shorten it or raise the limit"
        )
    if model is None:
        model = settings.model
    if not isinstance(model, str):
        raise InvalidInput(f"model must be a str naming a served model, got {type(model).__name__}")
    if model != settings.model and model not in settings.models:  # served_models, without its tuple
        raise UnknownModel(
            f"unknown model {model!r}: CARPOOL_MODEL/CARPOOL_MODELS here name "
            f"{', '.join(settings.served_models)}; pass one of them as model=, or add it to CARPOOL_MODELS "
            "(a producer's must name what the coordinators serve: `carpool status` shows it)"
        )
    return InferPayload(text=text, model=model)


def bind_item(task_name: str, args: Any, kwargs: Any) -> Any:
    """The one item of a ``@batched`` task's call, or raise :class:`InvalidInput`."""
    check_call_shape(task_name, args, kwargs)
    if kwargs or not isinstance(args, list | tuple) or len(args) != 1:
        raise InvalidInput(
            f"{task_name} takes exactly one item per request, got args={_short(args)} "
            f"kwargs={sorted(kwargs or {})}; pass several fields as one dict: .delay({{'a': 1, 'b': 2}})"
        )
    return args[0]


def validate_item(task_name: str, item: Any, settings: Settings) -> int:
    """Check that ``item`` travels as JSON and decodes to an equal value; returns its size in bytes."""
    try:
        encoded = dumps_exact(item)
    except (TypeError, ValueError) as exc:
        other = crosses_as_another(item)  # how to convert it, where it can be
        raise _not_json(task_name, f"{exc}: {other}" if other is not None else str(exc)) from None
    # What orjson writes natively but JSON gives back as another type (kombu gives a UUID back).
    other = None if type(item) in (str, int, float, bool) else crosses_as_another(item)
    if other is not None:
        raise _not_json(task_name, other)
    size = len(encoded)
    if size > settings.max_input_bytes:
        raise InputTooLong(
            f"{task_name}: the item is {size} bytes as JSON, over CARPOOL_MAX_INPUT_BYTES="
            f"{settings.max_input_bytes}; send less per request or raise the limit"
        )
    if encoded.find(b'"__type__"') >= 0:  # orjson never escapes a key's letters: an exact first check
        _no_type_tags(task_name, item)
    return size


def _not_json(task_name: str, why: str) -> InvalidInput:
    return InvalidInput(
        f"{task_name}: the item cannot travel as JSON unchanged ({why}); pass strings, finite numbers, "
        "integers within 64 bits (else a string), lists and dicts with string keys"
    )


def checked_length(task_name: str, value: Any) -> int:
    """A ``length`` function's answer as an int >= 0 (numpy integers too), or raise :class:`InvalidInput`."""
    try:
        if isinstance(value, bool):
            raise TypeError
        size = operator.index(value)
    except TypeError:
        raise InvalidInput(
            f"{task_name}: length() returned {_short(value)} ({type(value).__name__}), not an int; "
            "make the task's length function return an integer size"
        ) from None
    if size < 0:
        raise InvalidInput(f"{task_name}: length() returned {size}; sizes must be >= 0")
    if size > MAX_LENGTH:
        raise InvalidInput(
            f"{task_name}: length() returned {_short(size)}, above {MAX_LENGTH:,}; make the task's length"
            " function return the size to bin by (tokens, items, bytes), not a hash or an id"
        )
    return size


def _no_type_tags(task_name: str, item: Any) -> None:
    """Raise :class:`InvalidInput` if ``item`` holds a dict shaped like one of kombu's type tags
    (``{"__type__": "bytes", "__value__": ...}``): the worker decodes its batch with Celery's JSON,
    which would hand the function another value than the one sent, or fail on it."""
    for tag, decoded in kombu_tags(item):
        if isinstance(decoded, Exception):
            becomes = f"which fails on it ({tag_failure(tag, decoded)})"
        else:
            becomes = (
                f"which would hand your function {brief(decoded)} ({type(decoded).__name__}), "
                "not the dict sent"
            )
        raise InvalidInput(
            f"{task_name}: the item holds {brief(tag)}, a dict shaped like one of kombu's type tags "
            f"(its only keys __type__ and __value__), and the worker decodes its batch with Celery's "
            f"JSON, {becomes}; an item is a JSON value: rename the dict's keys (e.g. 'type' and "
            "'value') or add a third"
        )


# A request's size, summed over batches into 64-bit counters (padded tokens) and carried in reports:
# a bound no real size reaches keeps those sums from overflowing.
MAX_LENGTH = 2**31 - 1


class _Missing:
    pass


_MISSING = _Missing()


def _short_name(task_name: str) -> str:
    """How a caller names the task in code: ``infer`` for ``carpool.infer``, ``shout`` for ``myapp.shout``."""
    return task_name.rpartition(".")[2] or task_name


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

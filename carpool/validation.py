"""Request validation, shared by producers (at ``.delay()``) and the coordinator (for raw messages).

Every failure is an :class:`~carpool.errors.InvalidInput` whose message names the problem and what to
change; nothing here imports torch.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from carpool.config import Settings
from carpool.errors import InputTooLong, InvalidInput, UnknownModel


class InferPayload(BaseModel):
    """A validated ``carpool.infer`` request."""

    model_config = ConfigDict(strict=True, frozen=True)

    text: str
    model: str


def bind_infer_args(args: Any, kwargs: Any) -> tuple[Any, Any]:
    """(text, model) from ``infer``'s call arguments, as Celery would bind them."""
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
    if model not in settings.served_models:
        raise UnknownModel(
            f"unknown model {model!r}: this deployment serves {', '.join(settings.served_models)}; "
            "pass one of them as model=, or add it to CARPOOL_MODELS"
        )
    return InferPayload(text=text, model=model)


class _Missing:
    pass


_MISSING = _Missing()


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

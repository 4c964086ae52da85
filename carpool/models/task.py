"""``carpool.infer`` as a batched task: a text through one of the deployment's models.

Producer and coordinator: the call binds as ``infer(text, model=None)`` and routes by the served
model it names (two models never share a batch). Coordinator: one ``encode`` call per model per
take gives every text's token ids (with ``CARPOOL_TRUNCATE=false`` the texts over the model's window
are refused first, by ``count_tokens``); the ids travel in the request's slot (nothing does when the
model reads only the attention mask). Worker: the ids padded to a multiple of 8, one ``forward``.
The model protocol is :mod:`carpool.models.base`; nothing here imports torch.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

from carpool.batching.bins import PAD_MULTIPLE
from carpool.errors import InputTooLong, InvalidInput
from carpool.models import BatchModel, get_model
from carpool.registry import BatchCall, LaunchCall, Prepared, TaskSpec
from carpool.validation import bind_infer_args, validate_infer

if TYPE_CHECKING:
    from carpool.config import Settings

log = logging.getLogger(__name__)


def too_long(count: int, max_length: int, model_name: str) -> InputTooLong:
    return InputTooLong(
        f"text is {count} tokens, over the {max_length}-token window of {model_name}; "
        "shorten it, or set CARPOOL_TRUNCATE=true to cut it as sentence-transformers does"
    )


@dataclass(frozen=True, slots=True)
class InferSpec(TaskSpec):
    """The built-in text models as one task; its routing keys are the served models' names."""

    #: the (unloaded) model by name, on the coordinator; stand-ins are passed here in tests
    model_of: Callable[[str], BatchModel] = field(default=get_model, kw_only=True, compare=False)

    # A model's outputs are its own to make JSON-ready (protocol); checking each would cost per request.
    checks_outputs: ClassVar[bool] = False
    raises_as_raised: ClassVar[bool] = False  # a model's failure reaches infer's callers as ModelError
    may_change_items: ClassVar[bool] = False  # forward_padded only reads the ids
    inference_mode: ClassVar[bool] = True

    @property
    def pad_multiple(self) -> int:
        return PAD_MULTIPLE  # forward_padded pads to it

    def keys(self, settings: Settings) -> tuple[str, ...]:
        return settings.served_models

    def accept(self, args: Any, kwargs: Any, settings: Settings) -> tuple[str, Any]:
        text, model = bind_infer_args(args, kwargs)
        payload = validate_infer(text, model, settings)
        return payload.model, payload.text

    def prepare(self, key: str, values: list[Any], settings: Settings) -> Prepared:
        model = self.model_of(key)
        texts: list[str] = values
        refused: dict[int, InvalidInput] = {}
        if not settings.truncate and hasattr(model, "count_tokens"):
            window = model.max_length
            counts = model.count_tokens(texts)
            refused = {i: too_long(n, window, key) for i, n in enumerate(counts) if n > window}
            if refused:
                texts = [text for i, text in enumerate(texts) if i not in refused]
        rows: list[Any] = model.encode(texts)
        lengths: list[int | InvalidInput] = [len(row) for row in rows]
        if model.needs_token_ids and not getattr(model, "plain_ids", False):
            rows = [_as_ints(row) for row in rows]
            for i, row in enumerate(rows):
                if row is None:
                    lengths[i] = not_ids(key)
        items: list[Any] = rows if model.needs_token_ids else [None] * len(rows)
        for i in sorted(refused):  # back into place, so positions match the values given
            lengths.insert(i, refused[i])
            items.insert(i, None)
        return Prepared(lengths, items)

    def warm_up(self, settings: Settings) -> None:
        """Build each served model and load its tokenizer now, not inside the first request's latency."""
        for name in settings.served_models:
            model = self.model_of(name)  # an unknown model stops the coordinator here
            try:
                model.encode(["warm up"])
            except Exception:
                log.exception("warming up the tokenizer of %s failed; requests will show the error", name)

    def load(self, device: str, settings: Settings) -> None:
        from carpool.gpu_worker.runner import loaded_model

        for name in settings.served_models:
            t0 = time.perf_counter()
            loaded_model(name, device, settings.autocast_bf16)
            log.info("model %s loaded on %s in %.1fs", name, device, time.perf_counter() - t0)

    def batch_function(self, key: str, device: str, settings: Settings) -> BatchCall:
        from carpool.gpu_worker.runner import forward_padded, loaded_model

        model = loaded_model(key, device, settings.autocast_bf16)
        return partial(forward_padded, model, serializer=settings.result_serializer)

    def launch_function(self, key: str, device: str, settings: Settings) -> LaunchCall | None:
        from carpool.gpu_worker.runner import launch_padded, loaded_model

        model = loaded_model(key, device, settings.autocast_bf16)
        if getattr(model, "launch", None) is None:
            return None
        return partial(launch_padded, model, serializer=settings.result_serializer)


_INT64 = (-(2**63), 2**63 - 1)


def _as_ints(row: Any) -> list[int] | None:
    """A custom model's row of ids (a list, a numpy array, numpy ints, a tuple) as a list of Python
    ints, the JSON its batch message carries; None for a row holding anything but integers that
    the worker's int64 padding holds (a float is no id: padded, it would be cut to one; nor is a
    bool, though Python counts it an int)."""
    try:
        ids = [operator.index(token) for token in row]
    except TypeError:
        return None
    if any(type(token) is bool for token in row):
        return None
    if ids and not (_INT64[0] <= min(ids) and max(ids) <= _INT64[1]):
        return None
    return ids


def not_ids(model_name: str) -> InvalidInput:
    return InvalidInput(
        f"{model_name}: encode() gave this text token ids that are not all integers within int64;"
        " a model's encode() must give each text's ids as a list of ints (numpy integer arrays are"
        " converted)"
    )

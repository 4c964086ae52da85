"""Padding and running batches on a model; no Redis or Celery here.

A worker runs every task's batch the same way: ``run_call_isolating(call, items, lengths)`` calls the
task's batch function (a model's under ``torch.inference_mode()``; a ``@batched`` function as it is,
as called directly or by Celery) and, when a batch raises, halves it until the failing items are
alone, so one bad request fails only itself. ``carpool.infer``'s batch function is
``forward_padded``: one numpy fill of a (rows x padded length) array, one ``forward``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import traceback
from collections.abc import Callable, Mapping, Sequence, Set
from functools import partial
from typing import Any, cast

import numpy as np

from carpool.batching.bins import padded_length
from carpool.codec import float32_rows
from carpool.errors import DeviceLost, described, device_lost, stops_the_process, user_failure
from carpool.models import BatchModel, get_model

log = logging.getLogger(__name__)

_loaded: dict[str, BatchModel] = {}
_load_lock = threading.Lock()


def pick_device(setting: str, name: str = "CARPOOL_DEVICE") -> str:
    """The device ``setting`` (auto, cpu, cuda; an adapter's also cuda:N) stands for here; ``name``
    is where it was set. A CUDA device torch does not see is a configuration error said here, not
    an error from inside torch at the first batch."""
    import torch

    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind, colon, index = setting.partition(":")
    if kind == "cuda":
        from carpool.errors import ConfigError

        if not torch.cuda.is_available():
            raise ConfigError(f"{name}={setting} but torch sees no CUDA device; use auto or cpu")
        count = torch.cuda.device_count()
        if colon and not (index.isdigit() and int(index) < count):
            raise ConfigError(
                f"{name}={setting} but torch sees {count} CUDA device(s), cuda:0 to cuda:{count - 1} (the"
                " ones CUDA_VISIBLE_DEVICES leaves, renumbered from 0); name one of those"
            )
    return setting


def loaded_model(name: str, device: str = "cpu", autocast_bf16: bool = False) -> BatchModel:
    """The model ``name`` with weights on ``device``, loaded once per process (after any fork)."""
    model = _loaded.get(name)
    if model is None:
        with _load_lock:
            model = _loaded.get(name)
            if model is None:
                model = get_model(name)
                if autocast_bf16:
                    model.load(device, autocast_bf16=True)
                else:  # passed only when set, so a model lacking the keyword loads while bf16 is off
                    model.load(device)
                _loaded[name] = model
    return model


def pad(
    rows: Sequence[Sequence[int] | None], lengths: Sequence[int], pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, attention_mask), both int64 of shape (rows, longest rounded up to a multiple of 8)."""
    width = padded_length(max(lengths))
    ids = np.full((len(lengths), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(lengths), width), dtype=np.int64)
    for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        if row is not None:
            ids[i, :n] = row
        mask[i, :n] = 1
    return ids, mask


def forward_padded(
    model: BatchModel, rows: Sequence[Sequence[int] | None], lengths: Sequence[int], serializer: str = "json"
) -> Sequence[Any]:
    """``model.forward`` of the rows padded: ``carpool.infer``'s batch function on a worker, whose
    results are stored with ``serializer``."""
    ids, mask = pad(rows, lengths, model.pad_id)
    return output_rows(model.forward(ids, mask), serializer)


def launch_padded(
    model: BatchModel, rows: Sequence[Sequence[int] | None], lengths: Sequence[int], serializer: str = "json"
) -> Callable[[], Sequence[Any]]:
    """``model.launch`` of the rows padded (under ``inference_mode``); the function returned waits
    for the batch and gives what :func:`forward_padded` would have."""
    ids, mask = pad(rows, lengths, model.pad_id)
    torch = sys.modules.get("torch")
    with torch.inference_mode() if torch is not None else contextlib.nullcontext():
        collect = model.launch(ids, mask)  # type: ignore[attr-defined]
    return lambda: output_rows(collect(), serializer)


def output_rows(outputs: Any, serializer: str = "json") -> Sequence[Any]:
    """A model's outputs, one per row: a numpy array's rows stay arrays (written straight from them;
    float32 ones to be stored as JSON as :func:`carpool.codec.float32_rows` gives them, since only
    JSON's decimals can read back as another float32), a 1-D array's values become Python numbers;
    any other outputs are returned as they are."""
    if type(outputs) is not np.ndarray:
        return cast(Sequence[Any], outputs)
    if outputs.ndim < 2:
        return cast(list[Any], outputs.tolist())
    if outputs.dtype == np.float32 and serializer == "json":
        return float32_rows(outputs)
    return list(outputs)


def run_padded(model: BatchModel, rows: Sequence[Sequence[int] | None], lengths: Sequence[int]) -> list[Any]:
    """One forward of the padded rows under ``inference_mode``, one output per row (as lists, where
    the model gave numpy rows)."""
    return [_plain(out) for out in run_call(partial(forward_padded, model), rows, lengths)]


def run_isolating(
    model: BatchModel, rows: Sequence[Sequence[int] | None], lengths: Sequence[int]
) -> list[tuple[bool, Any]]:
    """Per row (ok, output-or-exception) of ``model``, outputs as lists where the model gave numpy
    rows (what plain Celery stores); see :func:`run_call_isolating`."""
    outcomes = run_call_isolating(partial(forward_padded, model), rows, lengths)
    return [(ok, _plain(out) if ok else out) for ok, out in outcomes]


def _plain(output: Any) -> Any:
    """A numpy row as the list of Python numbers it holds; any other output as it is."""
    return output.tolist() if type(output) is np.ndarray else output


class OutputCountMismatch(Exception):
    """A batch function returned a different number of outputs than it was given items."""


def run_call(
    call: Callable[[Any, Any], Sequence[Any]],
    items: Sequence[Any],
    lengths: Sequence[int],
    inference: bool = True,
) -> list[Any]:
    """``call(items, lengths)``, checked to give one output per item; with ``inference``, under
    ``inference_mode`` if torch is loaded (a batch function that never imported torch needs none)."""
    torch = sys.modules.get("torch") if inference else None
    context = torch.inference_mode() if torch is not None else contextlib.nullcontext()
    with context:  # a generator's outputs are computed as they are listed: in the context too
        return one_per_item(call(items, lengths), len(lengths))


def one_per_item(outputs: Any, count: int) -> list[Any]:
    """A batch's ``outputs`` as a list, or :class:`OutputCountMismatch` unless it holds ``count``.
    A string, a mapping or a set is refused whatever its size: as a list it would be characters,
    keys, or outputs in no particular order, handed to callers as if they were theirs."""
    if isinstance(outputs, str | bytes | bytearray | Mapping | Set):
        raise OutputCountMismatch(
            f"returned {type(outputs).__name__}, not a list with one output per item, in the items' order"
        )
    try:
        iterator = iter(outputs)
    except TypeError:
        raise OutputCountMismatch(
            f"returned {type(outputs).__name__}, not a list with one output per item"
        ) from None
    # Outside the check: what a generator or map raises as it runs is the function's own failure,
    # split to its items as any other, not a batch that returned the wrong thing.
    listed: list[Any] = list(iterator)
    if len(listed) != count:
        raise OutputCountMismatch(f"returned {len(listed)} outputs for {count} items")
    return listed


def run_call_isolating(
    call: Callable[[Any, Any], Sequence[Any]],
    items: Sequence[Any],
    lengths: Sequence[int],
    pristine: Callable[[], list[Any]] | None = None,
    inference: bool = True,
) -> list[tuple[bool, Any]]:
    """Per item (ok, output-or-exception): a batch that raises is split in halves until failures are
    alone (out-of-memory errors too: smaller halves fit). A wrong number of outputs fails the whole
    batch: splitting cannot say which output is whose.

    Each call gets a list of its own, so a function that sorts its batch in place does not reorder
    the items the halves are cut from. ``pristine``: the items as they were before any call
    (:func:`pristine_items`), for a function that may change an item itself: the halves are cut from
    those, not from what the failed call left. ``sys.exit()`` or another BaseException in the function
    fails its items, not the process (see :func:`~carpool.errors.stops_the_process`)."""
    try:
        return [(True, out) for out in run_call(call, list(items), lengths, inference)]
    except OutputCountMismatch as exc:
        return [(False, exc)] * len(lengths)
    except BaseException as raised:
        if stops_the_process(raised):
            raise
        if device_lost(raised):  # no half would run either: the batch fails whole (see DeviceLost)
            release_frames(raised)
            raise DeviceLost(
                f"the device failed ({described(raised)}); every later call on it in this worker would"
                " fail too, so the worker stops, to be started again with a fresh device context"
            ) from None
        failure = user_failure(raised)
        out_of_memory = _out_of_memory(raised)
        # Its traceback's frames hold the failed call's locals: on a GPU, the tensors whose memory
        # the halves need (an out-of-memory error's halves would fail for want of it) and, for a
        # failure kept as its item's outcome, until that is stored. The text of the traceback stays.
        release_frames(failure)
        if len(lengths) == 1:
            return [(False, failure)]
        log.warning("batch of %d failed (%s); splitting to isolate", len(lengths), described(failure))
        del failure
    # Split outside the handler: a failure in a half is then its own exception, its traceback the
    # raise alone, not chained to each larger batch's failure (nor holding their items alive).
    if out_of_memory:
        _free_accelerator_memory()
    if pristine is not None:
        items = pristine()
    half = len(lengths) // 2
    first = second = None
    if pristine is not None:
        outer = pristine
        first, second = (lambda: outer()[:half]), (lambda: outer()[half:])
    return run_call_isolating(call, items[:half], lengths[:half], first, inference) + run_call_isolating(
        call, items[half:], lengths[half:], second, inference
    )


def pristine_items(items: Sequence[Any]) -> Callable[[], list[Any]]:
    """A function giving a fresh copy of ``items`` as they are now, whatever is done to them later:
    a batch's JSON items are kept as orjson's bytes (anything else as a deep copy)."""
    import copy

    import orjson

    try:
        kept = orjson.dumps(items, option=orjson.OPT_PASSTHROUGH_SUBCLASS)
    except TypeError:
        frozen = copy.deepcopy(list(items))
        return lambda: copy.deepcopy(frozen)
    return lambda: cast("list[Any]", orjson.loads(kept))


def run_items_isolating(fn: Callable[[list[Any]], Sequence[Any]], items: list[Any]) -> list[tuple[bool, Any]]:
    """:func:`run_call_isolating` of a function of the items alone, as a ``@batched`` task's."""
    call = lambda batch, _lengths: fn(batch)  # noqa: E731
    return run_call_isolating(call, items, [0] * len(items), pristine_items(items), inference=False)


def release_frames(failure: BaseException) -> None:
    """Clear the local variables of the frames in the tracebacks of ``failure`` and of the
    exceptions it was raised from or during (what a batch function held when it raised), keeping
    the tracebacks themselves: their text is formatted from code and line numbers alone."""
    seen: set[int] = set()
    exc: BaseException | None = failure
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def _out_of_memory(raised: BaseException) -> bool:
    torch = sys.modules.get("torch")  # a batch function that never imported torch holds no CUDA memory
    return torch is not None and isinstance(raised, torch.cuda.OutOfMemoryError)


def _free_accelerator_memory() -> None:
    """Hand the CUDA memory torch caches but no longer uses back to the device, after an
    out-of-memory error only: for the memory the halves need torch reuses its cache itself (and
    frees it before it reports running out), so after any other failure this costs the next
    batch its allocations for nothing; other users of the device may need it, though."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_single(model_name: str, text: str, device: str = "cpu", autocast_bf16: bool = False) -> Any:
    """One text, no batching: what a plain Celery worker does with ``carpool.infer``, on ``device``
    (what :func:`pick_device` gives) as a carpool worker would run it."""
    model = loaded_model(model_name, device, autocast_bf16)
    ids = model.encode([text])[0]
    return run_padded(model, [ids if model.needs_token_ids else None], [len(ids)])[0]

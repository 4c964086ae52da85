"""What every built-in adapter shares: a local model directory, lengths without torch, lazy loading.

An adapter is built where a task module is imported (producers too), so building one does no I/O;
``length`` runs on the coordinator and reads only JSON and ``tokenizer.json`` (the ``tokenizers``
library, no torch); ``load`` and ``__call__`` run on a worker and build the model once per process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from carpool.errors import ConfigError, InvalidInput
from carpool.models.bert_ascii import AsciiPath, ascii_path, encode_ids

log = logging.getLogger(__name__)

LengthBy = Literal["tokens", "chars"]

#: a text, or a (text, text_pair) pair, as the tokenizer takes it
TextInput = tuple[str, str | None]

# English averages about four characters per token in BERT-style vocabularies; good enough to bin by.
_CHARS_PER_TOKEN = 4


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or {} when the file is absent."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (ValueError, OSError) as exc:  # not JSON (a truncated copy), unreadable
        raise ConfigError(f"{path} could not be read as JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return data


def window_of(model_dir: Path) -> int | None:
    """The tokenizer's ``model_max_length`` capped at the model's position embeddings, as
    sentence-transformers and transformers truncate; None when neither file says."""
    tokenizer_max = read_json(model_dir / "tokenizer_config.json").get("model_max_length")
    positions = read_json(model_dir / "config.json").get("max_position_embeddings")
    limits = [int(n) for n in (tokenizer_max, positions) if isinstance(n, int | float) and n > 0]
    return min(limits) if limits else None


class Adapter(ABC):
    """A batch function over one local model directory: ``adapter(items) -> outputs``, one per item.

    ``length(item)`` is the item's length in tokens (special tokens included, capped at
    ``max_length``); ``load()`` builds the model on the first call in each process and never again.
    """

    kind: str

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        device: str = "auto",
        max_length: int | None = None,
        length_by: LengthBy = "tokens",
    ) -> None:
        if max_length is not None and max_length < 1:
            raise ValueError(f"max_length must be an integer >= 1 or None, got {max_length}")
        if length_by not in ("tokens", "chars"):
            raise ValueError(f"length_by must be 'tokens' or 'chars', got {length_by!r}")
        self.path = Path(path)
        self.device_setting = device
        self.length_by: LengthBy = length_by
        self._max_length = max_length
        self._counter: Any = None
        self._counter_ascii: AsciiPath | None = None
        self._model: Any = None
        self._load_lock = threading.Lock()
        #: the device the model was loaded onto; None until ``load``
        self.device: str | None = None
        #: whether batches run under bfloat16 autocast (``load``'s ``autocast_bf16``, on CUDA only)
        self.autocast_bf16 = False

    def __repr__(self) -> str:
        return f"{self.kind}({str(self.path)!r})"

    # --- coordinator side: JSON and tokenizer.json only ---

    @cached_property
    def max_length(self) -> int:
        """Longest input in tokens, special tokens included; longer inputs are truncated to it."""
        if self._max_length is not None:
            return self._max_length
        window = self._default_max_length(self.model_dir)
        if window is None:
            raise ConfigError(f"{self!r}: no model_max_length or max_position_embeddings; pass max_length=")
        return window

    @property
    def model_dir(self) -> Path:
        """The model directory; refusing a missing one keeps a hub id from ever being downloaded."""
        if not self.path.is_dir():
            raise ConfigError(f"{self!r}: {self.path} is not a directory; adapters load local models only")
        return self.path

    def warm_up(self) -> None:
        """What ``length`` needs, built now (coordinator start): the window, and the tokenizer when
        lengths are counted in tokens. Raises :class:`~carpool.errors.ConfigError` naming the path
        when the model directory is missing or damaged on this host."""
        _ = self.max_length
        if self.length_by == "tokens":
            self._token_counter()

    def length(self, item: Any) -> int:
        """The item's token count (capped at ``max_length``); cheap enough for the coordinator."""
        return self.lengths([item])[0]

    def lengths(self, items: Sequence[Any]) -> list[int]:
        """``length`` of each item, tokenized together."""
        inputs = [self.parse(item) for item in items]
        window = self.max_length
        if self.length_by == "chars":
            return [min(window, _estimate(text, pair)) for text, pair in inputs]
        counter = self._token_counter()
        # The fast form (tokenizers 0.20+) skips character offsets, which a count never needs.
        encode_batch = getattr(counter, "encode_batch_fast", counter.encode_batch)
        if self._counter_ascii is not None and all(pair is None for _, pair in inputs):
            ids = encode_ids([text for text, _ in inputs], encode_batch, self._counter_ascii)
            return [min(window, len(i)) for i in ids]
        encodings = encode_batch([text if pair is None else (text, pair) for text, pair in inputs])
        return [min(window, len(e.ids)) for e in encodings]

    def _token_counter(self) -> Any:
        if self._counter is None:
            from tokenizers import Tokenizer

            file = self.tokenizer_dir / "tokenizer.json"
            if not file.is_file():
                raise ConfigError(f"{self!r}: no {file} to count tokens with; use length_by='chars'")
            counter = Tokenizer.from_file(str(file))
            # Some tokenizer.json files pin padding or truncation; a length must be the bare count.
            counter.no_padding()
            counter.no_truncation()
            self._counter_ascii = ascii_path(counter)  # an uncased BERT tokenizer's cheaper path
            self._counter = counter
        return self._counter

    @property
    def tokenizer_dir(self) -> Path:
        """Where ``tokenizer.json`` lives."""
        return self.model_dir

    @abstractmethod
    def parse(self, item: Any) -> TextInput:
        """The (text, text_pair) an item stands for; ``InvalidInput`` when it has the wrong shape."""

    def _default_max_length(self, model_dir: Path) -> int | None:
        return window_of(model_dir)

    # --- worker side ---

    def load(self, device: str | None = None, *, autocast_bf16: bool = False) -> None:
        """Build the model on the adapter's own ``device`` when it names one (``cpu`` keeps a model off
        the GPU), else on ``device`` (the worker's, ``CARPOOL_DEVICE``), else "auto": CUDA when
        present. ``autocast_bf16`` (the worker's ``CARPOOL_AUTOCAST_BF16``): run each batch's
        forward under bfloat16 autocast where the model is on CUDA, as ``carpool.infer``'s models do;
        outputs stay float32. Idempotent and thread-safe; call it after any fork."""
        if self._model is not None:
            return
        with self._load_lock:
            if self._model is not None:
                return
            from transformers.utils import logging as hf_logging

            from carpool.gpu_worker.runner import pick_device

            # A progress bar per worker start is noise in logs.
            hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
            if self.device_setting != "auto":
                resolved = pick_device(self.device_setting, f"{self!r}'s device")
            else:
                resolved = pick_device(device or "auto")
            model_dir = self.model_dir
            log.info("loading %r on %s", self, resolved)
            self._model = self._build(model_dir, resolved)
            self.autocast_bf16 = autocast_bf16 and resolved.startswith("cuda")
            self.device = resolved

    def __call__(self, items: Sequence[Any]) -> list[Any]:
        """One output per item, in order."""
        if not items:
            return []
        inputs = [self.parse(item) for item in items]
        self.load()
        return self._run(inputs)

    def _precision(self) -> contextlib.AbstractContextManager[Any]:
        """Where a batch's forward runs: under bfloat16 autocast when ``autocast_bf16`` holds."""
        if not self.autocast_bf16:
            return contextlib.nullcontext()
        import torch

        return torch.autocast("cuda", dtype=torch.bfloat16)

    @abstractmethod
    def _build(self, model_dir: Path, device: str) -> Any:
        """The loaded model (never None) on ``device``."""

    @abstractmethod
    def _run(self, inputs: list[TextInput]) -> list[Any]:
        """Outputs for parsed inputs, with the model loaded."""


def _estimate(text: str, pair: str | None) -> int:
    if pair is None:
        return -(-len(text) // _CHARS_PER_TOKEN) + 2  # [CLS] text [SEP]
    return -(-len(text) // _CHARS_PER_TOKEN) - (-len(pair) // _CHARS_PER_TOKEN) + 3


def parse_text(item: Any, adapter: Adapter) -> TextInput:
    if not isinstance(item, str):
        raise InvalidInput(f"{adapter.kind} takes a string, got {type(item).__name__}")
    return item, None


def parse_pair(item: Any, adapter: Adapter, first: str, second: str) -> TextInput:
    """A pair given as ``[a, b]`` or ``{first: a, second: b}``."""
    if isinstance(item, dict):
        a, b = item.get(first), item.get(second)
        shape = f"a dict with keys {first!r} and {second!r}"
    elif isinstance(item, list | tuple) and len(item) == 2:
        a, b = item
        shape = "a list of two strings"
    else:
        raise InvalidInput(
            f"{adapter.kind} takes [{first}, {second}] or {{{first!r}: ..., {second!r}: ...}}, "
            f"got {type(item).__name__}"
        )
    if not isinstance(a, str) or not isinstance(b, str):
        raise InvalidInput(f"{adapter.kind} takes {shape}, got {item!r:.200}")
    return a, b

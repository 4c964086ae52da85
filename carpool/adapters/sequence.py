"""``reranker(path)`` and ``classifier(path)``: a transformers sequence-classification directory.

Both tokenize on the worker as sentence-transformers' ``CrossEncoder`` does (pairs truncated longest
first to the model's window), pad to a multiple of 8 and run one forward per batch.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from carpool.adapters.base import Adapter, LengthBy, TextInput, parse_pair, parse_text
from carpool.batching.bins import PAD_MULTIPLE

Activation = Literal["auto", "sigmoid", "softmax", "none"]


@dataclass
class _Loaded:
    tokenizer: Any
    model: Any
    accepts: frozenset[str]  # the features the model's forward takes
    torch: Any


class _SequenceModel(Adapter):
    #: the multiple each batch is padded to (its max_tokens counts lengths rounded up to it)
    pad_multiple = PAD_MULTIPLE

    def _build(self, model_dir: Path, device: str) -> _Loaded:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        model = AutoModelForSequenceClassification.from_pretrained(str(model_dir), local_files_only=True)
        model = model.eval().to(device)
        accepts = frozenset(inspect.signature(model.forward).parameters)
        return _Loaded(tokenizer, model, accepts, torch)

    def _logits(self, inputs: list[TextInput]) -> Any:
        """Float32 logits (rows x labels) on the model's device."""
        loaded: _Loaded = self._model
        texts = [text for text, _ in inputs]
        pairs = [pair for _, pair in inputs]
        features = loaded.tokenizer(
            texts,
            None if pairs[0] is None else pairs,
            padding=True,
            truncation="longest_first",
            max_length=self.max_length,
            pad_to_multiple_of=PAD_MULTIPLE,
            return_tensors="pt",
        )
        features = {k: v.to(self.device) for k, v in features.items() if k in loaded.accepts}
        with loaded.torch.inference_mode(), self._precision():
            return loaded.model(**features).logits.float()


def _activation_fn(torch: Any, activation: Activation) -> Callable[[Any], Any]:
    if activation == "sigmoid":
        return torch.sigmoid  # type: ignore[no-any-return]
    if activation == "softmax":
        return lambda logits: torch.softmax(logits, dim=-1)
    return lambda logits: logits


class Reranker(_SequenceModel):
    """[query, passage] -> relevance score, as sentence-transformers' ``CrossEncoder.predict``."""

    kind = "reranker"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        device: str = "auto",
        max_length: int | None = None,
        length_by: LengthBy = "tokens",
        activation: Activation = "auto",
    ) -> None:
        super().__init__(path, device=device, max_length=max_length, length_by=length_by)
        #: "auto": what ``CrossEncoder`` applies, the model's saved choice, else sigmoid for one label
        self.activation = activation
        self._activation: Callable[[Any], Any] = lambda logits: logits

    def parse(self, item: Any) -> TextInput:
        return parse_pair(item, self, "query", "passage")

    def _build(self, model_dir: Path, device: str) -> _Loaded:
        loaded = super()._build(model_dir, device)
        if self.activation == "auto":
            self._activation = _saved_activation(loaded.torch, loaded.model.config)
        else:
            self._activation = _activation_fn(loaded.torch, self.activation)
        return loaded

    def _run(self, inputs: list[TextInput]) -> list[Any]:
        scores = self._activation(self._logits(inputs))
        if scores.shape[-1] == 1:
            scores = scores.squeeze(-1)
        return scores.cpu().tolist()  # type: ignore[no-any-return]


def _saved_activation(torch: Any, config: Any) -> Callable[[Any], Any]:
    """The activation ``CrossEncoder`` applies by default: the torch module saved with the model
    (under the current key or the pre-v4 one), else sigmoid for one label and none for several."""
    saved = (getattr(config, "sentence_transformers", None) or {}).get("activation_fn") or getattr(
        config, "sbert_ce_default_activation_function", None
    )
    # Like CrossEncoder, instantiate only torch's own modules: a saved path is not trusted code.
    if isinstance(saved, str) and saved.startswith("torch."):
        module, _, name = saved.rpartition(".")
        return getattr(importlib.import_module(module), name)()  # type: ignore[no-any-return]
    return _activation_fn(torch, "sigmoid" if config.num_labels == 1 else "none")


class Classifier(_SequenceModel):
    """Text (or [text, text_pair]) -> {"label": best label, "scores": {label: probability}}."""

    kind = "classifier"

    def parse(self, item: Any) -> TextInput:
        if isinstance(item, str):
            return parse_text(item, self)
        return parse_pair(item, self, "text", "text_pair")

    def _run(self, inputs: list[TextInput]) -> list[Any]:
        singles = [i for i, (_, pair) in enumerate(inputs) if pair is None]
        if 0 < len(singles) < len(inputs):
            # A tokenizer call takes texts or pairs, not both: run each kind, then restore the order.
            pairs = [i for i, (_, pair) in enumerate(inputs) if pair is not None]
            outputs: list[Any] = [None] * len(inputs)
            for group in (singles, pairs):
                for i, output in zip(group, self._run([inputs[i] for i in group]), strict=True):
                    outputs[i] = output
            return outputs
        loaded: _Loaded = self._model
        config = loaded.model.config
        # As transformers' text-classification pipeline: independent labels get a sigmoid each.
        multi_label = config.problem_type == "multi_label_classification" or config.num_labels == 1
        activation = _activation_fn(loaded.torch, "sigmoid" if multi_label else "softmax")
        probs = activation(self._logits(inputs))
        labels = [str(config.id2label[i]) for i in range(probs.shape[-1])]
        best = probs.argmax(dim=-1).tolist()
        return [
            {"label": labels[b], "scores": dict(zip(labels, row, strict=True))}
            for b, row in zip(best, probs.cpu().tolist(), strict=True)
        ]


def reranker(
    path: str | os.PathLike[str],
    *,
    device: str = "auto",
    max_length: int | None = None,
    length_by: LengthBy = "tokens",
    activation: Activation = "auto",
) -> Reranker:
    """A batch function scoring [query, passage] pairs with the cross-encoder in directory ``path``."""
    return Reranker(path, device=device, max_length=max_length, length_by=length_by, activation=activation)


def classifier(
    path: str | os.PathLike[str],
    *,
    device: str = "auto",
    max_length: int | None = None,
    length_by: LengthBy = "tokens",
) -> Classifier:
    """A batch function labelling texts with the sequence classifier in directory ``path``."""
    return Classifier(path, device=device, max_length=max_length, length_by=length_by)

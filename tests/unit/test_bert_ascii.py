"""The ASCII fast path gives the ids of MiniLM's full tokenizer, text by text, in any mix."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers

from carpool.models.bert_ascii import ascii_path, encode_ids
from carpool.models.minilm import MiniLM
from carpool.tools.workload import ACCELERATOR_MIX, mixed_texts

MODEL = MiniLM()
TOKENIZER = MODEL._get_tokenizer()
PATH = ascii_path(TOKENIZER)
ASCII = st.text(st.characters(max_codepoint=127), max_size=60)
WORDS = st.sampled_from(
    ["[MASK]", "[cls]", "[SEP]x", "naïve", "Tokyo東京", "co-op", "e=mc^2", "\x0b", "\x1f", "A.B", "[UNK]"]
)


def _full(texts: list[str]) -> list[list[int]]:
    return [e.ids for e in TOKENIZER.encode_batch(texts, add_special_tokens=True)]


def test_minilm_takes_the_fast_path() -> None:
    assert PATH is not None and MODEL._ascii is not None


def test_every_ascii_character_alone_and_between_words() -> None:
    texts = [chr(c) for c in range(128)] + [f"Word{chr(c)}word {chr(c)}X" for c in range(128)]
    assert encode_ids(texts, TOKENIZER.encode_batch, PATH) == _full(texts)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(ASCII, WORDS), min_size=1, max_size=8))
def test_random_texts_get_the_full_tokenizers_ids(texts: list[str]) -> None:
    assert encode_ids(texts, TOKENIZER.encode_batch, PATH) == _full(texts)


def test_the_bench_workload_and_its_long_texts() -> None:
    texts = mixed_texts(300, seed=5, mix=ACCELERATOR_MIX)
    assert MODEL.encode(texts) == _full(texts)


def test_texts_naming_an_added_token_keep_its_id() -> None:
    ids = MODEL.encode(["fill the [MASK] in", "fill the [mask] in"])
    assert ids == _full(["fill the [MASK] in", "fill the [mask] in"])
    assert TOKENIZER.token_to_id("[MASK]") in ids[0]


def test_another_tokenizer_has_no_fast_path() -> None:
    other = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    assert ascii_path(other) is None
    other.normalizer = normalizers.BertNormalizer(lowercase=False)
    assert ascii_path(other) is None, "a cased BERT normalizer keeps capitals: no fast path"

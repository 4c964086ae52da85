"""MiniLM tokenizes only the head of a text past its window, with the same ids as a full pass."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.models.minilm import HEAD_CHARS_PER_TOKEN, MiniLM

MODEL = MiniLM()
WORDS = st.sampled_from(
    ["the", "tokenizer", "Überraschung", "a", "x" * 40, "naïve", "東京", "co-op", "3.14", "\t", "\n", "!?"]
)


def _full(text: str) -> list[int]:
    ids: list[int] = MODEL._get_tokenizer().encode(text, add_special_tokens=True).ids
    return ids


@settings(max_examples=60, deadline=None)
@given(st.lists(WORDS, min_size=200, max_size=1500).map(" ".join))
def test_long_texts_get_the_ids_of_a_full_pass(text: str) -> None:
    assert MODEL.encode([text]) == [_full(text)]


def test_a_long_text_without_spaces_or_with_long_words_falls_back_to_the_full_text() -> None:
    limit = MODEL.max_length * HEAD_CHARS_PER_TOKEN
    no_space = "y" * (limit * 2)
    long_words = " ".join(["z" * 150] * (limit // 100))
    assert MODEL.encode([no_space, long_words]) == [_full(no_space), _full(long_words)]
    assert len(MODEL.encode(["word " * 10_000])[0]) == MODEL.max_length

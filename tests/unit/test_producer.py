"""The producer side: light import, validation at .delay() with messages that say what to change."""

from __future__ import annotations

import pytest

from carpool.config import Settings
from carpool.errors import InputTooLong, InvalidInput, UnknownModel
from carpool.validation import bind_infer_args, validate_infer

SETTINGS = Settings(model="toy", models=("toy", "minilm"), max_input_bytes=100)


def test_valid_request() -> None:
    payload = validate_infer("hello", None, SETTINGS)
    assert payload.text == "hello" and payload.model == "toy"
    assert validate_infer("hi", "minilm", SETTINGS).model == "minilm"


@pytest.mark.parametrize(
    ("text", "model", "error", "needles"),
    [
        (42, None, InvalidInput, ["text must be a str", "int", "str(value)"]),
        (b"bytes", None, InvalidInput, ["text must be a str", "bytes"]),
        ("bad \ud800 surrogate", None, InvalidInput, ["not valid Unicode", "position 4", "surrogate"]),
        ("x" * 101, None, InputTooLong, ["101 bytes", "CARPOOL_MAX_INPUT_BYTES=100"]),
        ("é" * 51, None, InputTooLong, ["102 bytes"]),
        ("ok", "gpt-9", UnknownModel, ["unknown model 'gpt-9'", "toy, minilm", "CARPOOL_MODELS"]),
        ("ok", 3, InvalidInput, ["model must be a str"]),
    ],
)
def test_bad_input_is_named(text: object, model: object, error: type[Exception], needles: list[str]) -> None:
    with pytest.raises(error) as err:
        validate_infer(text, model, SETTINGS)
    for needle in needles:
        assert needle in str(err.value)


def test_argument_binding() -> None:
    assert bind_infer_args(["t"], {}) == ("t", None)
    assert bind_infer_args([], {"text": "t", "model": "m"}) == ("t", "m")
    assert bind_infer_args(["t", "m"], None) == ("t", "m")
    with pytest.raises(InvalidInput, match="needs a text"):
        bind_infer_args([], {})
    with pytest.raises(InvalidInput, match=r"takes \(text, model=None\)"):
        bind_infer_args(["a", "b", "c"], {})
    with pytest.raises(InvalidInput, match=r"takes \(text, model=None\)"):
        bind_infer_args([], {"txt": "a"})


def test_delay_rejects_bad_input_before_anything_is_sent() -> None:
    # No broker runs for unit tests: reaching the broker would raise a connection error instead.
    from carpool.tasks import infer

    with pytest.raises(InvalidInput, match="text must be a str"):
        infer.delay(["not", "a", "string"])
    with pytest.raises(UnknownModel):
        infer.delay("fine text", model="nope")

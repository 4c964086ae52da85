"""Intake: raw request messages -> the policy's requests and refusals, with both clocks passed in."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest

from carpool.config import Settings
from carpool.coordinator.intake import decode_taken, take_in, to_request
from carpool.errors import InputTooLong, InvalidInput, MalformedMessage, QueueFull, UnknownModel
from carpool.models.task import InferSpec
from tests.unit.messages import message

NOW = 500.0  # the coordinator's monotonic clock
WALL = 1_700_000_000.0  # the wall clock at the same instant


class Words:
    """A stand-in model: one token (its length) per word, a window of 4 tokens; records encode calls."""

    max_length = 4
    pad_id = 0
    needs_token_ids = True

    def __init__(self) -> None:
        self.encoded: list[list[str]] = []

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        self.encoded.append(list(texts))
        return [[len(w) for w in t.split()][: self.max_length] for t in texts]

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return [len(t.split()) for t in texts]

    def load(self, device: str, *, autocast_bf16: bool = False) -> None: ...

    def forward(self, input_ids: Any, attention_mask: Any) -> Sequence[Any]:
        return [int(n) for n in attention_mask.sum(axis=1)]  # each row's real length


def settings(**overrides: Any) -> Settings:
    fields: dict[str, Any] = {"model": "toy", "models": ("toy", "null"), "default_deadline_s": 60.0}
    fields.update(overrides)
    return Settings(**fields)


def run(
    taken: list[tuple[str, bytes]], room: int = 100, models: dict[str, Any] | None = None, **overrides: Any
) -> Any:
    models = models or {"toy": Words(), "null": Words()}
    specs = {"carpool.infer": InferSpec("carpool.infer", model_of=models.__getitem__)}
    out = take_in(taken, settings=settings(**overrides), specs=specs, room=room, now=NOW, wall_now=WALL)
    return out, models


def test_a_request_becomes_a_policy_request_on_the_coordinators_clock() -> None:
    out, _ = run([("a", message("a", "one two three", sent_at=WALL - 2.0, priority=3))])
    assert not out.refused and not out.malformed
    [(msg, req)] = out.admitted
    assert msg.id == req.id == "a"
    assert req.model == "toy" and req.length == 3 and req.priority == 3
    assert req.arrival_s == pytest.approx(NOW - 2.0)
    assert req.deadline_s == pytest.approx(NOW - 2.0 + 60.0)  # sent_at + CARPOOL_DEFAULT_DEADLINE_S
    assert req.payload == {
        "id": "a",
        "item": [3, 3, 5],
        "len": 3,
        "sent_at": WALL - 2.0,
        "deadline": WALL + 58.0,
    }


def test_expires_sets_the_deadline_and_a_missing_stamp_means_sent_now() -> None:
    expires = "2023-11-14T22:13:30+00:00"  # WALL + 10 s
    out, _ = run([("a", message("a", "hi", expires=expires))])
    [(_, req)] = out.admitted
    assert req.arrival_s == NOW
    assert req.deadline_s == pytest.approx(NOW + 10.0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), True])
def test_a_stamp_or_expiry_that_is_not_a_finite_number_counts_as_absent(bad: float) -> None:
    """JSON from other clients may hold NaN or Infinity (Python's json writes them): such a sent-at
    or expires means nothing, so the request counts as sent now with the default deadline, and the
    batch message carries only finite numbers."""
    raw = message("a", "hi", extra_headers={"carpool_sent_at": bad, "expires": bad})
    out, _ = run([("a", raw)])
    [(_, req)] = out.admitted
    assert req.arrival_s == NOW
    assert req.deadline_s == pytest.approx(NOW + 60.0)
    assert req.payload["deadline"] == pytest.approx(WALL + 60.0)
    assert req.payload["sent_at"] == WALL


@pytest.mark.parametrize("ahead_s", [5.0, 3600.0])
def test_a_producer_clock_ahead_of_ours_counts_as_arriving_now(ahead_s: float) -> None:
    """Its wait and its default deadline both count from now: a clock an hour ahead must not give
    a request an hour more than ``CARPOOL_DEFAULT_DEADLINE_S`` before it fails."""
    req = to_request(
        decode_taken("a", message("a", "hi", sent_at=WALL + ahead_s)), "toy", [1], 1, NOW, WALL, 60.0
    )
    assert req.arrival_s == NOW
    assert req.deadline_s == pytest.approx(NOW + 60.0)
    slot: Any = req.payload
    assert slot["deadline"] == pytest.approx(WALL + 60.0)
    assert slot["sent_at"] == WALL + ahead_s  # as sent: its errors say by whose clock


def test_a_model_without_token_ids_gets_lengths_only() -> None:
    reads_mask_only = Words()
    reads_mask_only.needs_token_ids = False
    out, _ = run([("a", message("a", "one two"))], models={"toy": reads_mask_only})
    [(_, req)] = out.admitted
    assert req.payload["item"] is None and req.payload["len"] == req.length == 2


def test_each_models_texts_are_tokenized_in_one_call() -> None:
    taken = [
        ("a", message("a", "x y")),
        ("b", message("b", "p", model="null")),
        ("c", message("c", "z")),
    ]
    out, models = run(taken)
    assert [req.model for _, req in out.admitted] == ["toy", "toy", "null"]
    assert models["toy"].encoded == [["x y", "z"]]
    assert models["null"].encoded == [["p"]]


def test_a_message_that_is_not_a_request_is_set_aside_for_the_dead_letter_list() -> None:
    out, _ = run([("junk", b"not json"), ("a", message("a", "fine"))])
    [bad] = out.malformed
    assert bad.id == "junk" and bad.raw == b"not json" and "not JSON" in bad.reason
    assert [req.id for _, req in out.admitted] == ["a"]


def test_a_message_taken_under_another_id_is_malformed() -> None:
    with pytest.raises(MalformedMessage, match="not the message's only id key"):
        decode_taken("taken-as", message("real-id", "hi"))


def test_invalid_arguments_are_refused_with_the_reason() -> None:
    out, _ = run([("a", message("a", 42)), ("b", message("b", "hi", model="nope"))])
    assert [(r.id, r.reason) for r in out.refused] == [("a", "invalid"), ("b", "invalid")]
    assert isinstance(out.refused[0].error, InvalidInput)
    assert isinstance(out.refused[1].error, UnknownModel)
    assert not out.admitted


def test_past_max_pending_requests_are_refused_as_queue_full() -> None:
    taken = [(i, message(i, "hi")) for i in ("a", "b", "c")]
    out, _ = run(taken, room=2, max_pending=7)
    assert [req.id for _, req in out.admitted] == ["a", "b"]
    [refused] = out.refused
    assert refused.id == "c" and refused.reason == "queue_full"
    assert isinstance(refused.error, QueueFull) and "7 requests" in str(refused.error)


def test_with_truncation_off_texts_over_the_window_are_refused() -> None:
    taken = [("a", message("a", "one two three four five")), ("b", message("b", "short"))]
    out, models = run(taken, truncate=False)
    assert [req.id for _, req in out.admitted] == ["b"]
    [refused] = out.refused
    assert refused.reason == "too_long" and isinstance(refused.error, InputTooLong)
    assert "5 tokens, over the 4-token window" in str(refused.error)
    assert models["toy"].encoded == [["short"]]


def test_with_truncation_on_long_texts_are_cut_to_the_window() -> None:
    out, _ = run([("a", message("a", "one two three four five"))])
    [(_, req)] = out.admitted
    assert req.length == 4


def iso(wall_s: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(wall_s, UTC).isoformat()


def test_a_request_with_an_eta_arrives_at_its_eta_and_its_default_deadline_counts_from_then() -> None:
    out, _ = run([("a", message("a", "hi", sent_at=WALL - 1.0, eta=iso(WALL + 30.0)))])
    [(msg, req)] = out.admitted
    assert msg.eta_at == pytest.approx(WALL + 30.0)
    assert req.arrival_s == pytest.approx(NOW + 30.0)
    assert req.deadline_s == pytest.approx(NOW + 30.0 + 60.0)
    assert req.payload["deadline"] == pytest.approx(WALL + 90.0)
    with_expiry = message("b", "hi", eta=iso(WALL + 30.0), expires=iso(WALL + 45.0))
    [(_, req)] = run([("b", with_expiry)])[0].admitted
    assert req.deadline_s == pytest.approx(NOW + 45.0)


def test_an_eta_already_past_counts_the_wait_from_the_eta() -> None:
    out, _ = run([("a", message("a", "hi", sent_at=WALL - 10.0, eta=iso(WALL - 4.0)))])
    [(_, req)] = out.admitted
    assert req.arrival_s == pytest.approx(NOW - 4.0)


def test_callbacks_chain_and_canvas_ids_ride_in_the_slot_only_when_present() -> None:
    callback: dict[str, Any] = {
        "task": "carpool.infer",
        "args": [],
        "kwargs": {},
        "options": {},
        "subtask_type": None,
    }
    step = {**callback, "options": {"task_id": "next"}}
    embed = {"callbacks": [callback], "errbacks": None, "chain": [step], "chord": None}
    linked = message("a", "hi", embed=embed, extra_headers={"root_id": "root", "parent_id": None})
    child = message("b", "hi", extra_headers={"root_id": "root", "parent_id": "a"})
    plain = message("c", "hi", extra_headers={"root_id": None, "parent_id": None})
    out, _ = run([("a", linked), ("b", child), ("c", plain)])
    (msg_a, a), (msg_b, b), (msg_c, c) = out.admitted
    assert msg_a.links == a.payload["links"] == {"callbacks": [callback], "chain": [step], "root_id": "root"}
    assert msg_b.links == b.payload["links"] == {"root_id": "root", "parent_id": "a"}
    assert msg_c.links is None and "links" not in c.payload


class Burning(Words):
    """Words whose encode burns a known stretch of this thread's CPU, as a tokenizer does."""

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        started = time.thread_time()
        while time.thread_time() - started < 0.02:
            pass
        return super().encode(texts)


def test_a_take_counts_the_cpu_its_prepare_calls_spent_and_the_values_they_prepared() -> None:
    """``carpool bench --accelerator`` reads tokenization's share of the coordinator's CPU from these
    (the stats hash's prepare_cpu_ns and prepared), not from a tokenizer timed elsewhere."""
    taken = [(f"r{i}", message(f"r{i}", "one two", model="toy" if i % 2 else "null")) for i in range(6)]
    out, _ = run(taken, models={"toy": Burning(), "null": Burning()})
    assert len(out.admitted) == 6 and out.prepared == 6
    assert 0.04e9 <= out.prepare_cpu_ns < 5e9  # two encode calls (one per model), 20 ms each
    refused_only, _ = run([("bad", message("bad", 7))])
    assert refused_only.prepared == 0 and refused_only.prepare_cpu_ns == 0

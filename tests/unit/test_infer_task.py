"""``carpool.infer`` is one task of the batched mechanism: registered where every task is, accepted,
prepared and run by the same code as a ``@batched`` task, on the coordinator and on the worker."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from carpool.codec import loads
from carpool.config import Settings
from carpool.errors import ConfigError, InputTooLong, InvalidInput
from carpool.models.task import InferSpec
from carpool.names import INFER_TASK
from carpool.registry import BatchedSpec, check_batch_queue, import_task_modules, registered, routing_keys
from carpool.tasks import batched, infer
from tests.unit.messages import message
from tests.unit.test_coordinator_loop import Clocks, coordinator
from tests.unit.test_intake import Words
from tests.unit.test_worker_semantics import FakeStore

SETTINGS = Settings(model="toy", models=("toy", "null"))


@batched(length=len, name="unit.infer_peer")
def reverse(texts: list[str]) -> list[str]:
    return [t[::-1] for t in texts]


def test_infer_is_registered_as_the_tasks_of_carpool_imports_are() -> None:
    import_task_modules(())  # what the coordinator and every worker call first
    spec = registered()[INFER_TASK]
    assert isinstance(spec, InferSpec) and infer.spec is spec and reverse.spec is registered()[reverse.name]
    # Its routing keys are the served models: infer's requests are batched per model.
    assert spec.keys(SETTINGS) == ("toy", "null") and reverse.spec.keys(SETTINGS) == (reverse.name,)
    assert spec.accept(["hi"], {}, SETTINGS) == ("toy", "hi")
    assert spec.accept([], {"text": "hi", "model": "null"}, SETTINGS) == ("null", "hi")
    with pytest.raises(InvalidInput, match="text must be a str"):
        spec.accept([3], {}, SETTINGS)


def test_a_routing_key_two_tasks_claim_is_a_configuration_error() -> None:
    settings = Settings(model="toy", models=("toy", "pkg.mod:Model"))
    clash = BatchedSpec("pkg.mod:Model", lambda items: items, len)
    assert routing_keys([infer.spec, reverse.spec], settings)["toy"] is infer.spec
    with pytest.raises(ConfigError, match=r"routes requests of both carpool\.infer and pkg\.mod:Model"):
        routing_keys([infer.spec, clash], settings)


def test_a_task_whose_batches_would_go_to_the_request_queue_is_refused_by_coordinator_and_worker() -> None:
    settings = Settings(model="toy", request_queue="team.requests")
    astray = BatchedSpec("unit.astray", lambda items: items, len, batch_queue="team.requests")
    own = BatchedSpec("unit.own_queue", lambda items: items, len, batch_queue="team.batches.own")
    assert routing_keys([own], settings) == {"unit.own_queue": own}
    refused = r"'unit\.astray': batch_queue='team\.requests' is the request queue"
    with pytest.raises(ConfigError, match=refused):
        routing_keys([infer.spec, astray], settings)
    with pytest.raises(ConfigError, match=refused):
        check_batch_queue(astray, settings)  # what the worker's batch_queues() asks of each task


def test_prepare_tokenizes_once_and_refuses_texts_over_the_window_in_place() -> None:
    words = Words()
    spec = InferSpec(INFER_TASK, model_of=lambda name: words)
    texts = ["a bb", "one two three four five", "ccc", "x " * 9]
    lengths, items = spec.prepare("toy", texts, Settings(model="toy", truncate=False))
    assert words.encoded == [["a bb", "ccc"]], "one tokenizer call, for the texts that fit"
    assert [lengths[0], lengths[2]] == [2, 1] and [items[0], items[2]] == [[1, 2], [3]]
    for i, count in ((1, 5), (3, 9)):
        assert isinstance(lengths[i], InputTooLong) and items[i] is None
        assert f"text is {count} tokens, over the 4-token window of toy" in str(lengths[i])
    lengths, items = spec.prepare("toy", texts, Settings(model="toy"))  # truncation on: all cut to fit
    assert lengths == [2, 4, 1, 4]


class OddIds(Words):
    """Words, except that each text names the row its encode gives: a user's tokenizer of any kind."""

    ROWS: dict[str, Any] = {
        "plain": [5, 6],
        "numpy": np.array([5, 6], dtype=np.int32),
        "mixed": [5, np.int64(6)],
        "tuple": (5, 6),
        "late float": [5, 6.5],
        "numpy floats": np.array([5.0, 6.0]),
        "past int64": [5, 2**63],
        "below int64": [-(2**63) - 1, 5],
        "an object": [5, object()],
        "a bool": [5, True],  # an int to Python, but no tokenizer's id: a mask or a flag mixed in
        "numpy bools": np.array([True, False]),
        "empty": [],
    }

    def encode(self, texts: Sequence[str]) -> list[Any]:
        return [self.ROWS[t] for t in texts]


def test_prepare_checks_every_id_of_a_models_rows_and_refuses_only_the_rows_no_worker_can_pad() -> None:
    # Only a row's first id was looked at: a later float rode on and the worker's padding cut it to
    # an integer, so its request succeeded on ids its model never gave.
    spec = InferSpec(INFER_TASK, model_of=lambda name: OddIds())
    texts = list(OddIds.ROWS)
    lengths, items = spec.prepare("toy", texts, Settings(model="toy"))
    got = dict(zip(texts, zip(lengths, items, strict=True), strict=True))
    for text in ("plain", "numpy", "mixed", "tuple"):
        length, row = got[text]
        assert length == 2 and row == [5, 6] and all(type(i) is int for i in row), text
    assert got["empty"] == (0, [])
    for text in (
        "late float",
        "numpy floats",
        "past int64",
        "below int64",
        "an object",
        "a bool",
        "numpy bools",
    ):
        length, _ = got[text]
        assert isinstance(length, InvalidInput), text
        assert "token ids that are not all integers within int64" in str(length)


def test_a_model_that_vouches_for_its_ids_is_not_checked() -> None:
    """The built-in tokenizers give lists of Python ints; checking each id would cost per request."""
    from carpool.models.minilm import MiniLM
    from carpool.models.toy import ToyModel

    assert MiniLM.plain_ids and ToyModel.plain_ids
    vouching = OddIds()
    vouching.plain_ids = True  # type: ignore[attr-defined]
    spec = InferSpec(INFER_TASK, model_of=lambda name: vouching)
    lengths, items = spec.prepare("toy", ["mixed"], Settings(model="toy"))
    assert lengths == [2] and items[0] is OddIds.ROWS["mixed"]


def test_infer_and_a_batched_task_go_through_one_coordinator_and_one_worker_path() -> None:
    from carpool.celery_edge.app import app
    from carpool.gpu_worker.runtime import WorkerRuntime

    clocks = Clocks()
    c = coordinator(clocks, workers=2, imports=(), max_wait_s=0.01)
    assert c.metrics.task_of("toy") == INFER_TASK and c.metrics.task_of(reverse.name) == reverse.name
    c.store.queue += [
        ("a", message("a", "one two three")),
        ("b", message("b", "abc", task=reverse.name)),
        ("c", message("c", "four five")),
    ]
    for _ in range(10):
        c.step()
        clocks.advance(0.05)
    batches = {b["task"]: loads(json.dumps(b)) for b in c.publisher._builders[c.settings.batch_queue].batches}
    assert set(batches) == {INFER_TASK, reverse.name}
    toy, peer = batches[INFER_TASK], batches[reverse.name]
    assert toy["model"] == "toy" and [r["id"] for r in toy["requests"]] == ["a", "c"]
    assert [len(r["item"]) for r in toy["requests"]] == [4, 3], "token ids travel"
    assert peer["model"] == reverse.name and peer["requests"][0]["item"] == "abc", "the item travels"

    worker = WorkerRuntime(app)
    worker.device, worker.dbs, worker.events.mode = "cpu", (0, 1), False
    store = worker.store = FakeStore()  # type: ignore[assignment]
    assert {INFER_TASK, reverse.name} <= set(worker.specs)
    results: dict[str, Any] = {}
    for message_ in (toy, peer):
        for slot in message_["requests"]:  # the coordinator's wall clock was a made-up one
            slot["deadline"] = 2e9
        report = worker.run(message_)
        assert report is not None, "no device stage started: run inline"
        assert report["size"] == len(message_["requests"]) and report["failed_model"] == 0
        results.update({task_id: meta["result"] for task_id, meta in store.writes})
    assert results["b"] == "cba"
    assert len(results["a"]) == len(results["c"]) == 32  # the toy model's vectors


def test_a_dedicated_worker_names_the_tasks_it_would_take_and_fail_and_says_to_serve_them() -> None:
    """A worker serving some of the tasks it imports (CARPOOL_SERVE_TASKS) warns at start of each other
    task whose batches share a queue it consumes, and a batch of one fails naming the setting."""
    from carpool.gpu_worker.serving import served_spec, served_tasks, unserved_neighbours

    settings = Settings(serve_tasks=("unit.infer_peer",))  # reverse, above
    specs = registered()
    served = served_tasks(settings.serve_tasks, specs)
    warnings = unserved_neighbours(settings, specs, served)
    assert any(
        f"consumes batch queue {settings.batch_queue} but does not serve {INFER_TASK}" in w for w in warnings
    )
    with pytest.raises(
        LookupError, match=r"CARPOOL_SERVE_TASKS / --tasks names only unit\.infer_peer\); add it there"
    ):
        served_spec({n: s for n, s in specs.items() if n in served}, served, INFER_TASK)
    with pytest.raises(LookupError, match="add its module to CARPOOL_IMPORTS here"):
        served_spec(specs, served, "nobody.knows")
    assert unserved_neighbours(Settings(), specs, served_tasks((), specs)) == [], "a worker serving all"

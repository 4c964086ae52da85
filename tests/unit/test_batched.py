"""@batched: the task it makes, what .delay() refuses before anything is sent, and how the
coordinator's intake measures and refuses items. No broker: every refusal happens before a publish."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import functools
import subprocess
import sys
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from carpool.batching import BatchPolicy, LatencyModel, Request
from carpool.batching.bins import PAD_MULTIPLE
from carpool.celery_app import app
from carpool.config import Settings
from carpool.coordinator import policy_config, task_policy_config
from carpool.coordinator.intake import take_in
from carpool.errors import ConfigError, InputTooLong, InvalidInput, UnsupportedOption
from carpool.models.task import InferSpec
from carpool.names import INFER_TASK
from carpool.registry import BatchedSpec, registered, spec_for
from carpool.tasks import batched, infer
from tests.unit.messages import message

NOW, WALL = 500.0, 1_700_000_000.0


# carpool.batched returns Any (the Celery task it builds is untyped), hence the ignores below.
@batched(length=len, max_batch=4, bins=(8, 32))
def shout(texts: list[str]) -> list[str]:
    return [t.upper() for t in texts]


@batched(length=lambda item: item["n"], name="unit.declared")
def declared(items: list[dict[str, Any]]) -> list[int]:
    return [item["n"] for item in items]


def test_the_decorator_makes_a_celery_task_named_like_celery_names_tasks() -> None:
    assert shout.name == f"{__name__}.shout"
    assert declared.name == "unit.declared"
    assert shout.spec.max_batch == 4 and shout.spec.bin_edges == (8, 32)
    assert spec_for(shout.name) is shout.spec and registered()[declared.name] is declared.spec
    assert shout.run("hi") == "HI"  # a plain Celery worker runs one item through the function


def test_the_tasks_own_limits_override_the_deployment_settings() -> None:
    base = policy_config(Settings(max_batch=32, bin_edges=(16, 64)))
    mine = task_policy_config(base, shout.spec)
    assert (mine.max_batch, mine.bin_edges, mine.max_tokens) == (4, (8, 32), base.max_tokens)
    # A @batched function's items are not padded: its lengths count as they are, where infer's are
    # rounded up to the multiple its worker pads to.
    assert task_policy_config(base, declared.spec) == dataclasses.replace(base, pad_multiple=1)
    assert task_policy_config(base, InferSpec(INFER_TASK)).pad_multiple == PAD_MULTIPLE == 8
    auto = task_policy_config(base, BatchedSpec("auto", lambda items: items, len, bin_edges="auto"))
    assert auto.auto_bins == 6


def test_max_tokens_counts_a_batched_tasks_lengths_unrounded() -> None:
    """``count x longest length`` as TASKS.md says: with max_tokens=30, ten items of length 3 make a
    batch (the policy review found three: each length was rounded up to 8, as infer's ids are padded)."""
    spec = BatchedSpec("unit.tokens30", lambda items: items, len, max_tokens=30, bin_edges=())
    assert BatchedSpec("unit.tokens1", lambda items: items, len, max_tokens=1).max_tokens == 1
    config = task_policy_config(policy_config(Settings()), spec)
    policy = BatchPolicy(config, LatencyModel(prior_base_s=0.01, prior_per_token_s=1e-4))
    for i in range(25):
        policy.add(Request(id=f"r{i}", model=spec.name, length=3, arrival_s=0.0, deadline_s=100.0))
    plan = policy.poll(1.0, free_workers=3, free_slots=3)
    assert [b.size for b in plan.batches] == [10, 10, 5]
    assert [b.padded_len for b in plan.batches] == [3, 3, 3]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_batch": 0}, "max_batch must be an integer >= 1"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer >= 1"),
        ({"bin_edges": (32, 8)}, "bins must be 'auto' or increasing"),
        ({"max_batch": 10**9}, r"max_batch must be <= 4096, as CARPOOL_MAX_BATCH must, not 1000000000"),
    ],
)
def test_bad_limits_are_refused_when_the_task_is_defined(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BatchedSpec("bad", lambda items: items, len, **kwargs)


@pytest.mark.parametrize(("bins", "shown"), [(16, "16"), ("16", "'16'"), ([16, 4], r"\(16, 4\)")])
def test_bins_that_are_no_increasing_edges_are_refused_by_the_decorator(bins: Any, shown: str) -> None:
    refused = rf"bins must be 'auto' or increasing positive integers, not {shown}$"
    with pytest.raises(ValueError, match=refused):
        batched(name="unit.bad_bins", bins=bins)(lambda items: items)


def test_two_functions_under_one_name_is_a_configuration_error() -> None:
    with pytest.raises(ConfigError, match=r"two batched tasks are named 'unit\.declared'"):
        batched(name="unit.declared")(lambda items: items)


_CLASH = """
from carpool.celery_app import app
from carpool.tasks import batched

def one(x):
    return x

if {plain_first}:
    app.task(name="unit.clash")(one).name
    batched(name="unit.clash")(lambda items: items).name
else:
    batched(name="unit.clash")(lambda items: items).name
    app.task(name="unit.clash")(one).name
"""


@pytest.mark.parametrize("plain_first", [True, False])
def test_a_batched_task_and_a_plain_task_under_one_name_is_a_configuration_error(plain_first: bool) -> None:
    # Celery would hand the first task registered under the name to the second decorator, silently.
    # A process of its own: every app finalized in it afterwards would meet the clash again.
    done = subprocess.run(
        [sys.executable, "-c", _CLASH.format(plain_first=plain_first)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "ConfigError: 'unit.clash' names both a @batched task and a plain Celery task" in done.stderr


@pytest.mark.parametrize(
    ("setting", "value", "match"),
    [
        ("task_compression", "zlib", r"task_compression='zlib' is not supported.*unset task_compression"),
        ("serializer", "pickle", r"task_serializer='pickle' is not supported.*task_serializer='json'"),
        ("serializer", "msgpack", r"task_serializer='msgpack' is not supported"),
        ("ignore_result", True, r"task_ignore_result=True is not supported.*set it False"),
        ("rate_limit", "10/m", r"rate_limit='10/m' is not supported by carpool tasks.*max_batch"),
        # Celery's worker enforces them without a header; carpool's ran past them without a word.
        ("time_limit", 2, r"time_limit=2 \(the task's, task_annotations' or task_time_limit\) is not"),
        ("task_time_limit", 60, r"time_limit=60 .*is not supported by carpool tasks.*\.get\(timeout="),
        ("task_soft_time_limit", 1, r"soft_time_limit=1 .*unset it for carpool's tasks"),
        # kombu pushed priority 5 to a list no coordinator drains: the request waited for ever.
        (
            "broker_transport_options",
            {"priority_steps": list(range(10))},
            r"priority_steps=\[0, 1, .*the coordinators drain the request lists of kombu's default steps",
        ),
        ("broker_transport_options", {"sep": ":"}, r"sep=':' is not supported by carpool tasks"),
    ],
)
def test_app_settings_a_request_cannot_honour_are_refused_before_anything_is_sent(
    monkeypatch: pytest.MonkeyPatch, setting: str, value: Any, match: str
) -> None:
    # Celery adds them to every call: a compressed or pickled request is one no coordinator reads.
    import carpool

    if setting.startswith("task_"):
        monkeypatch.setitem(app.conf, setting, value)
    elif setting == "broker_transport_options":
        monkeypatch.setitem(app.conf, setting, {**app.conf.broker_transport_options, **value})
    else:  # task_serializer / task_ignore_result: Celery copies them onto each task when it binds
        for task in (shout, infer):
            monkeypatch.setattr(task, setting, value)
        if setting != "rate_limit":  # a task's own (or task_annotations'); task_default_rate_limit is
            monkeypatch.setitem(app.conf, f"task_{setting}", value)  # copied onto each task as it binds
    for call in (
        lambda: shout.delay("a"),
        lambda: infer.apply_async(("a",), countdown=1),
        lambda: carpool.submit_many(["a"], task=shout),
        lambda: carpool.submit_many(["a"]),
    ):
        with pytest.raises(UnsupportedOption, match=match):
            call()


def test_an_item_nested_past_orjsons_limit_is_refused_naming_the_limit() -> None:
    """It was refused as if it held something other than lists (found by the review of foreign
    messages); the deepest nesting that travels is accepted."""
    from carpool.codec import MAX_DEPTH
    from carpool.validation import validate_item

    def nested(levels: int) -> list[Any]:
        value: list[Any] = []
        for _ in range(levels - 1):
            value = [value]
        return value

    assert validate_item(shout.name, nested(MAX_DEPTH), Settings()) == 2 * MAX_DEPTH
    with pytest.raises(InvalidInput, match=f"nested more than {MAX_DEPTH} levels deep"):
        shout.delay(nested(MAX_DEPTH + 1))


def test_a_module_imported_again_decorates_the_same_function_without_a_clash() -> None:
    def again(items: list[Any]) -> list[Any]:
        return items

    first = batched(name="unit.imported_twice")(again)
    second = batched(name="unit.imported_twice")(again)
    assert first.name == second.name == "unit.imported_twice"
    assert app.tasks["unit.imported_twice"].spec.fn is again


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: shout.delay("a", "b"), InvalidInput, "exactly one item"),
        (lambda: shout.apply_async((), {"text": "a"}), InvalidInput, "exactly one item"),
        (lambda: shout.delay({1: "int key"}), InvalidInput, "cannot travel as JSON"),
        (lambda: shout.delay(float("nan")), InvalidInput, "non-finite"),
        (lambda: shout.delay(2**70), InvalidInput, "64-bit"),
        (lambda: shout.delay({"when": object()}), InvalidInput, "cannot travel as JSON"),
        (lambda: shout.delay("x" * 70_000), InputTooLong, "CARPOOL_MAX_INPUT_BYTES"),
        (lambda: shout.apply_async(("a",), chord=infer.s()), UnsupportedOption, "chord"),
        (lambda: infer.apply_async(("a",), time_limit=3), UnsupportedOption, "time_limit"),
        (lambda: shout.apply_async(("a",), soft_time_limit=3), UnsupportedOption, "soft_time_limit"),
        (lambda: shout.apply_async(("a",), compression="gzip"), UnsupportedOption, "plain JSON"),
        (lambda: infer.apply_async(("a",), ignore_result=True), UnsupportedOption, "ignore_result"),
        (lambda: infer.apply_async(("a",), serializer="pickle"), UnsupportedOption, "plain JSON"),
    ],
)
def test_delay_refuses_what_it_cannot_send_or_honour_before_anything_is_sent(
    call: Callable[[], object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        call()


def _intake(taken: list[tuple[str, bytes]]) -> Any:
    specs = {shout.name: shout.spec, declared.name: declared.spec}
    return take_in(taken, settings=Settings(), specs=specs, room=100, now=NOW, wall_now=WALL)


def test_intake_measures_items_with_the_tasks_length_and_keeps_the_item_for_the_worker() -> None:
    out = _intake(
        [
            ("a", message("a", "hello", task=shout.name)),
            ("b", message("b", {"n": 7, "x": [1.5]}, task=declared.name)),
        ]
    )
    assert not out.refused and not out.malformed
    (_, a), (_, b) = sorted(out.admitted, key=lambda pair: pair[1].id)
    assert isinstance(a, Request) and (a.model, a.length) == (shout.name, 5)
    assert a.payload == {
        "id": "a",
        "item": "hello",
        "len": 5,
        "sent_at": WALL,
        "deadline": WALL + 60,
    }
    assert (b.model, b.length, b.payload["item"]) == (declared.name, 7, {"n": 7, "x": [1.5]})


def test_intake_fails_only_the_requests_whose_length_is_wrong() -> None:
    out = _intake(
        [
            ("ok", message("ok", {"n": 3}, task=declared.name)),
            ("raises", message("raises", {"m": 3}, task=declared.name)),
            ("text", message("text", {"n": "3"}, task=declared.name)),
            ("negative", message("negative", {"n": -1}, task=declared.name)),
            ("huge", message("huge", {"n": 2**64 - 1}, task=declared.name)),
            ("largest", message("largest", {"n": 2**31 - 1}, task=declared.name)),
            ("two", message("two", "a", "b", task=shout.name)),
            ("unknown", message("unknown", "a", task="someone.else")),
        ]
    )
    assert [req.id for _, req in out.admitted] == ["ok", "largest"]
    reasons = {r.id: str(r.error) for r in out.refused}
    # A size past any real one would overflow the 64-bit sums of padded tokens it goes into.
    assert "unit.declared: length() returned 18446744073709551615, above 2,147,483,647" in reasons["huge"]
    assert "unit.declared: length() raised KeyError" in reasons["raises"]
    assert "not an int" in reasons["text"] and ">= 0" in reasons["negative"]
    assert "exactly one item" in reasons["two"]
    # A task no coordinator serves (a module not in CARPOOL_IMPORTS yet): answered, not dead-lettered.
    assert out.malformed == [] and "unknown task name 'someone.else'" in reasons["unknown"]
    assert "add its module to CARPOOL_IMPORTS" in reasons["unknown"]
    assert next(r for r in out.refused if r.id == "unknown").task == "someone.else"


def test_metrics_label_each_series_with_its_task() -> None:
    from prometheus_client import CollectorRegistry

    from carpool.coordinator.metrics import CoordinatorMetrics

    registry = CollectorRegistry()
    metrics = CoordinatorMetrics(registry, task_of=lambda key: key if key == shout.name else "carpool.infer")
    metrics.batch_dispatched(shout.name, "1-8", 3, 24, 10, "full", [0.01])
    metrics.batch_dispatched("toy", "1-16", 2, 32, 20, "wait", [0.02, 0.03])
    metrics.set_depths({(shout.name, "9-32"): 4})
    assert (
        registry.get_sample_value(
            "carpool_batch_size_count", {"task": shout.name, "model": shout.name, "bin": "1-8"}
        )
        == 1
    )
    assert (
        registry.get_sample_value("carpool_wait_seconds_count", {"task": "carpool.infer", "model": "toy"})
        == 2
    )
    assert (
        registry.get_sample_value(
            "carpool_queue_depth", {"task": shout.name, "model": shout.name, "bin": "9-32"}
        )
        == 4
    )


@pytest.mark.parametrize("outputs", ["XZ", b"XZ", {"a": 1, "b": 2}, {"x", "z"}, frozenset("xz")])
def test_outputs_as_a_string_mapping_or_set_are_refused_whatever_their_size(outputs: Any) -> None:
    """As a list they would be characters, keys, or outputs in no order, each handed to a caller."""
    import numpy as np

    from carpool.gpu_worker.runner import OutputCountMismatch, one_per_item

    with pytest.raises(
        OutputCountMismatch, match=f"returned {type(outputs).__name__}, not a list with one output"
    ):
        one_per_item(outputs, 2)
    assert one_per_item(["X", "Z"], 2) == ["X", "Z"]
    assert one_per_item((o for o in "XZ"), 2) == ["X", "Z"]  # a generator's outputs are in order
    assert len(one_per_item(np.zeros((2, 3)), 2)) == 2


@pytest.mark.parametrize("lazy", ["generator", "map"])
def test_a_type_error_a_lazy_output_raises_as_it_runs_fails_only_its_item(lazy: str) -> None:
    """It failed the whole batch as "returned generator, not a list": the check for something
    that cannot be iterated caught what the function raised while it was listed."""
    from carpool.gpu_worker.runner import run_items_isolating

    def exclaim(item: Any) -> Any:
        return item + "!"  # a TypeError for an item that is no str

    def lazily(items: list[Any]) -> Any:
        return (exclaim(i) for i in items) if lazy == "generator" else map(exclaim, items)

    outcomes = run_items_isolating(lazily, ["ab", ["no"], "cd"])
    assert outcomes[0] == (True, "ab!") and outcomes[2] == (True, "cd!")
    assert not outcomes[1][0] and isinstance(outcomes[1][1], TypeError), outcomes[1]


def test_a_models_forward_runs_under_inference_mode_and_a_batched_function_as_called_directly() -> None:
    """A @batched function needing autograd worked when called directly and eagerly, and failed on
    a worker, which ran it under inference_mode (found by the review of users' functions)."""
    import torch

    from carpool.gpu_worker.runner import run_isolating, run_items_isolating

    seen: list[tuple[str, bool]] = []

    def fn(items: list[int]) -> list[int]:
        seen.append(("batched", torch.is_inference_mode_enabled()))
        return items

    class Model:
        max_length, pad_id, needs_token_ids = 8, 0, True

        def forward(self, ids: Any, mask: Any) -> list[int]:
            seen.append(("model", torch.is_inference_mode_enabled()))
            return [0] * len(ids)

    assert run_items_isolating(fn, [1, 2]) == [(True, 1), (True, 2)]
    assert run_isolating(Model(), [[1], [2]], [1, 1]) == [(True, 0), (True, 0)]  # type: ignore[arg-type]
    assert seen == [("batched", False), ("model", True)]


def test_an_async_function_is_refused_when_the_task_is_defined() -> None:
    async def embed(texts: list[str]) -> list[int]:
        return [len(t) for t in texts]

    class AsyncModel:
        async def __call__(self, texts: list[str]) -> list[int]:
            return [len(t) for t in texts]

    for function, task_name in ((embed, "unit.async_fn"), (AsyncModel(), "unit.async_object")):
        with pytest.raises(TypeError, match=f"{task_name} is async .*asyncio.run"):
            batched(function, name=task_name)  # type: ignore[arg-type]
        assert spec_for(task_name) is None  # nothing half-registered


def test_a_function_that_cannot_take_a_batch_alone_is_refused_when_the_task_is_defined() -> None:
    class Service:
        def embed(self, texts: list[str]) -> list[int]:
            return [len(t) for t in texts]

    refusals = [
        (
            Service.embed,
            "unit.in_class_body",
            r"takes \(self, texts\) \(a method decorated in its class body",
        ),
        (lambda a, b: a, "unit.two_args", r"takes \(a, b\): missing a required argument: 'b'"),
        (lambda: [], "unit.no_args", r"takes \(\): too many positional arguments"),
    ]
    for function, task_name, refusal in refusals:
        with pytest.raises(TypeError, match=refusal):
            batched(function, name=task_name)  # type: ignore[call-overload]
        assert spec_for(task_name) is None
    bound = batched(Service().embed, name="unit.bound_method")  # what the refusal suggests
    assert bound.apply(args=("abc",)).get() == 3

    def with_scale(fn: Callable[[int, list[str]], list[int]]) -> Callable[[list[str]], list[int]]:
        @functools.wraps(fn)
        def wrapper(texts: list[str]) -> list[int]:
            return fn(2, texts)

        return wrapper

    @with_scale
    def scaled_lengths(scale: int, texts: list[str]) -> list[int]:
        return [scale * len(t) for t in texts]

    # What workers call is the wrapper, which takes the list alone, whatever the function it wraps takes.
    assert batched(scaled_lengths, name="unit.wrapped").apply(args=("abc",)).get() == 6

    def logged(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs)

        return wrapper

    class Timed:
        @logged
        def embed(self, texts: list[str]) -> list[int]:
            return [len(t) for t in texts]

    # A wrapper that takes anything passes it on: judged by the method it wraps.
    with pytest.raises(TypeError, match=r"takes \(self, texts\) \(a method decorated in its class body"):
        batched(Timed.embed, name="unit.wrapped_in_class_body")
    assert batched(Timed().embed, name="unit.wrapped_bound").apply(args=("abcd",)).get() == 4


@pytest.mark.parametrize(
    ("name", "error", "message"),
    [
        ("carpool.run_batch", ValueError, "the name is carpool's worker task's"),
        ("celery.chord_unlock", ValueError, "the name is in Celery's own namespace"),
        ("", TypeError, r"name=\.\.\.\) must be a non-empty string"),
        ("  ", TypeError, r"name=\.\.\.\) must be a non-empty string"),
    ],
)
def test_a_name_carpool_or_celery_holds_or_an_empty_one_is_refused_when_the_task_is_defined(
    name: str, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        batched(lambda items: items, name=name)


def test_bins_given_as_a_numpy_array_are_read_as_edges() -> None:
    task = batched(lambda items: items, name="unit.numpy_bins", bins=np.array([8, 32]))  # type: ignore[call-overload]
    assert task.spec.bin_edges == (8, 32) and all(type(e) is int for e in task.spec.bin_edges)
    with pytest.raises(
        ValueError, match=r"bins must be 'auto' or increasing positive integers, not \(32, 8\)"
    ):
        batched(lambda items: items, name="unit.numpy_bins_down", bins=np.array([32, 8]))  # type: ignore[call-overload]


class _Loads:
    """An adapter-like object: heavy state built by load(device), as workers call it."""

    def __init__(self) -> None:
        self.loads: list[str] = []
        self.scale: int | None = None

    def load(self, device: str) -> None:
        self.loads.append(device)
        self.scale = 10

    def __call__(self, items: list[int]) -> list[int]:
        assert self.scale is not None, "called before load()"
        return [i * self.scale for i in items]


_loads = _Loads()
scaled = batched(_loads, name="unit.scaled", length=lambda item: 1)


@batched(length=len, name="unit.miscounts")
def miscounts(texts: list[str]) -> list[str]:
    return [*texts, "extra"]


@batched(length=len, name="unit.nan")
def nan(texts: list[str]) -> list[float]:
    return [float("nan")] * len(texts)


@batched(length=len, name="unit.raises")
def raises(texts: list[str]) -> list[str]:
    raise ValueError("no such word")


@batched(length=len, name="unit.quits")
def quits(texts: list[str]) -> list[str]:
    sys.exit(3)


@batched(length=len, name="unit.cancels")
def cancels(texts: list[str]) -> list[str]:
    raise asyncio.CancelledError


def test_eager_mode_runs_an_item_as_a_batch_worker_would() -> None:
    """task_always_eager and .apply() keep the worker's contract: load() once, one output per item,
    outputs JSON carries, failures as ModelError, inputs checked as .delay() checks them."""
    from carpool.celery_edge.app import app
    from carpool.errors import ModelError

    assert scaled.apply(args=(4,)).get() == 40 and scaled.apply(args=(5,)).get() == 50
    assert len(_loads.loads) == 1 and _loads.loads[0] in ("cpu", "cuda")  # once per process
    with pytest.raises(ModelError, match="OutputCountMismatch: returned 2 outputs for 1 items"):
        miscounts.apply(args=("a",)).get()
    with pytest.raises(ModelError, match="non-finite float"):
        nan.apply(args=("a",)).get()
    with pytest.raises(ValueError, match="no such word") as raised:  # as a Celery task's own exception
        raises.apply(args=("a",)).get()
    assert not isinstance(raised.value, ModelError)
    with pytest.raises(InvalidInput, match="exactly one item"):
        shout.apply(args=("a", "b"))
    # What the coordinator would refuse for its length() is refused here too.
    with pytest.raises(InvalidInput, match=r"unit.declared: length\(\) raised KeyError"):
        declared.apply(args=({"x": 1.5},)).get()
    with pytest.raises(InvalidInput, match="above 2,147,483,647"):
        declared.apply(args=({"n": 2**40},)).get()
    with pytest.raises(InvalidInput):
        shout.apply(args=({1, 2},))
    app.conf.task_always_eager = True
    try:
        assert scaled.delay(6).get() == 60 and shout.delay("hi").get() == "HI"
        with pytest.raises(ModelError, match="OutputCountMismatch"):
            miscounts.delay("a").get()
        # sys.exit() in the function fails the request, as on a batch worker; the caller runs on.
        with pytest.raises(ModelError, match=r"called sys\.exit\(3\)"):
            quits.delay("a").get()
        with pytest.raises(ModelError, match="raised CancelledError, a BaseException that is not"):
            cancels.delay("a").get()
    finally:
        app.conf.task_always_eager = False


@batched(length=lambda item: 1, name="unit.inspects")
def inspects(items: list[Any]) -> list[Any]:
    """Says what type each item's values arrived as, and marks each item it was given."""
    out = []
    for item in items:
        out.append({key: type(value).__name__ for key, value in item.items()})
        item["seen"] = True
    return out


@batched(length=lambda item: 1, name="unit.typed_outputs")
def typed_outputs(items: list[Any]) -> list[Any]:
    import numpy as np

    class Label(str):
        pass

    return [{"pair": (1, 2), "score": np.float64(0.25), "label": Label("x")} for _ in items]


@pytest.mark.parametrize("serializer", ["msgpack", "json"])
def test_eager_outputs_come_back_as_gets_from_a_worker_read_them(
    serializer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by the review of @batched tasks: eager mode returned the function's own tuple, numpy
    float and str subclass, where .get() of a worker's result gives a list, a float and a str."""
    from carpool.celery_edge.app import app, settings_of, state_of

    update = {"result_serializer": serializer}
    monkeypatch.setattr(state_of(app), "settings", settings_of(app).model_copy(update=update))
    out = typed_outputs.apply(args=("a",)).get()
    assert out == {"pair": [1, 2], "score": 0.25, "label": "x"}
    assert [type(out[k]) for k in ("pair", "score", "label")] == [list, float, str]


def test_apply_hands_the_function_its_item_as_a_worker_would_and_leaves_the_callers_alone() -> None:
    from carpool.celery_edge.app import app

    item = {"pair": (1, 2), "n": 3}
    assert inspects.apply(args=(item,)).get() == {"pair": "list", "n": "int"}
    assert item == {"pair": (1, 2), "n": 3}, "the caller's object is not the function's to change"
    app.conf.task_always_eager = True
    try:
        assert inspects.delay(item).get() == {"pair": "list", "n": "int"}
    finally:
        app.conf.task_always_eager = False
    assert item == {"pair": (1, 2), "n": 3}


def test_a_failure_isolated_by_splitting_carries_its_own_traceback_once() -> None:
    """Split outside the handler: not chained to each larger batch's failure, as Celery stores one raise."""
    from carpool.celery_edge.compat import traceback_of
    from carpool.gpu_worker.runner import run_items_isolating

    def fragile(items: list[str]) -> list[str]:
        if "boom" in items:
            raise ValueError("boom is not a word I take")
        return items

    outcomes = run_items_isolating(fragile, ["a", "b", "c", "boom", "d", "e", "f", "g"])
    assert [ok for ok, _ in outcomes] == [True, True, True, False, True, True, True, True]
    error = outcomes[3][1]
    assert error.__context__ is None
    text = traceback_of(error) or ""
    assert text.count('raise ValueError("boom is not a word I take")') == 1, text


class _Device:
    """A device of 8 units whose allocations are freed when their last reference goes, as the
    CUDA caching allocator's blocks are: what a failed call's frames still hold stays in use."""

    def __init__(self) -> None:
        self.in_use = 0

    def alloc(self, units: int) -> object:
        if self.in_use + units > 8:
            raise MemoryError(f"out of device memory: {units} units wanted, {self.in_use} of 8 in use")
        block = _Block()
        self.in_use += units
        weakref.finalize(block, self._free, units)
        return block

    def _free(self, units: int) -> None:
        self.in_use -= units


class _Block:
    pass


def test_the_halves_of_a_batch_split_for_want_of_memory_do_not_meet_the_failed_calls_memory() -> None:
    from carpool.gpu_worker.runner import run_items_isolating

    device = _Device()

    def forward(items: list[str]) -> list[str]:
        activations = device.alloc(len(items))  # noqa: F841  (held while the next one is made)
        scores = device.alloc(2 * len(items))  # noqa: F841
        return [item.upper() for item in items]

    assert run_items_isolating(forward, ["a", "b"]) == [(True, "A"), (True, "B")]  # peaks at 6 of 8
    assert device.in_use == 0
    outcomes = run_items_isolating(forward, ["a", "b", "c", "d"])  # 4 + 8 units: out of memory
    assert outcomes == [(True, "A"), (True, "B"), (True, "C"), (True, "D")]
    assert device.in_use == 0


def test_a_failure_kept_as_an_outcome_holds_none_of_the_failed_calls_locals_but_keeps_its_traceback() -> None:
    from carpool.celery_edge.compat import traceback_of
    from carpool.gpu_worker.runner import run_items_isolating

    device = _Device()

    def forward(items: list[str]) -> list[str]:
        held = device.alloc(1)  # noqa: F841
        if "boom" in items:
            raise ValueError("boom is not a word I take")
        return items

    outcomes = run_items_isolating(forward, ["a", "boom"])
    assert [ok for ok, _ in outcomes] == [True, False]
    assert device.in_use == 0  # not until the outcome is stored
    text = traceback_of(outcomes[1][1]) or ""
    assert 'raise ValueError("boom is not a word I take")' in text, text


def _sorting(items: list[dict[str, Any]]) -> list[int]:
    """Sorts its batch in place (to cut padding), answers in the order given; refuses x == 0."""
    order = list(items)
    items.sort(key=lambda item: item["x"])
    if any(item["x"] == 0 for item in items):
        raise ValueError("x must not be 0")
    return [10 * item["x"] for item in order]


def _doubling(items: list[dict[str, Any]]) -> list[int]:
    """Changes each item in place before it looks at them all; refuses x == 0."""
    for item in items:
        item["x"] *= 2
    if any(item["x"] == 0 for item in items):
        raise ValueError("x must not be 0")
    return [item["x"] for item in items]


@pytest.mark.parametrize(("fn", "expected"), [(_sorting, lambda x: 10 * x), (_doubling, lambda x: 2 * x)])
def test_a_batch_split_after_a_failure_runs_the_items_as_sent_whatever_the_failed_call_did_to_them(
    fn: Callable[[list[dict[str, Any]]], list[int]], expected: Callable[[int], int]
) -> None:
    # The halves were cut from the list the failed call had sorted (requests got each other's
    # outputs, a good one the error) or from items it had changed (doubled again on each retry).
    from carpool.gpu_worker.runner import run_items_isolating

    xs = [5, 3, 9, 1, 7, 2, 0]
    outcomes = run_items_isolating(fn, [{"x": x} for x in xs])
    for x, (ok, out) in zip(xs, outcomes, strict=True):
        if x == 0:
            assert not ok and isinstance(out, ValueError)
        else:
            assert ok and out == expected(x), (x, out)


def test_sys_exit_in_a_batch_function_fails_its_items_and_celerys_shutdown_passes_through() -> None:
    from celery.exceptions import WorkerTerminate

    from carpool.errors import ModelError
    from carpool.gpu_worker.runner import run_items_isolating

    def exits(items: list[str]) -> list[str]:
        if "exit" in items:
            sys.exit(3)  # a library giving up the way scripts do
        return [item.upper() for item in items]

    outcomes = run_items_isolating(exits, ["a", "exit", "b", "c"])
    assert [out for ok, out in outcomes if ok] == ["A", "B", "C"]
    [(_, error)] = [o for o in outcomes if not o[0]]
    assert isinstance(error, ModelError) and "called sys.exit(3)" in str(error)

    def terminated(items: list[str]) -> list[str]:
        raise WorkerTerminate(1)  # Celery's hard shutdown, raised in the worker's main thread

    with pytest.raises(WorkerTerminate):
        run_items_isolating(terminated, ["a", "b"])


class _OwnBaseException(BaseException):
    """A library's own BaseException subclass, as some define for "stop now"."""


@pytest.mark.parametrize(
    "raised", [asyncio.CancelledError(), _OwnBaseException("give up"), GeneratorExit("from a library")]
)
def test_a_base_exception_in_a_batch_function_fails_its_items_and_ctrl_c_passes_through(
    raised: BaseException,
) -> None:
    # CancelledError out of a function's asyncio.run() stopped the worker, then each worker the
    # batch reached through lease recovery.
    from carpool.errors import ModelError
    from carpool.gpu_worker.runner import run_items_isolating

    def cancels(items: list[str]) -> list[str]:
        if "cancel" in items:
            raise raised
        return [item.upper() for item in items]

    outcomes = run_items_isolating(cancels, ["a", "cancel", "b", "c"])
    assert [out for ok, out in outcomes if ok] == ["A", "B", "C"]
    [(_, error)] = [o for o in outcomes if not o[0]]
    assert isinstance(error, ModelError)
    assert f"raised {type(raised).__name__}" in str(error) and "not an Exception" in str(error)

    def interrupted(items: list[str]) -> list[str]:
        raise KeyboardInterrupt  # the operator's Ctrl-C stops the worker

    with pytest.raises(KeyboardInterrupt):
        run_items_isolating(interrupted, ["a", "b"])


def test_a_base_exception_in_a_length_function_or_prepare_fails_only_that_request_at_intake() -> None:
    from carpool.config import Settings
    from carpool.coordinator.intake import prepared

    def cancelling_length(item: str) -> int:
        if item == "cancel":
            raise asyncio.CancelledError
        return len(item)

    spec = BatchedSpec("unit.cancelling_length", fn=lambda items: items, length=cancelling_length)
    measured = spec.measured(["ab", "cancel", "abc"])
    assert measured[0] == 2 and measured[2] == 3
    assert str(measured[1]) == "unit.cancelling_length: length() raised CancelledError; fix the item"
    out = prepared(spec, spec.name, ["ab", "cancel", "abc"], Settings())
    assert out.lengths[0] == 2 and out.lengths[2] == 3 and isinstance(out.lengths[1], InvalidInput)
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C still stops the coordinator

        def interrupted(item: str) -> int:
            raise KeyboardInterrupt

        BatchedSpec("unit.interrupted_length", fn=lambda items: items, length=interrupted).measured(["a"])


def test_sys_exit_in_a_length_function_fails_only_that_request_at_intake() -> None:
    spec = BatchedSpec("unit.exiting_length", fn=lambda items: items, length=_exiting_length)
    assert [str(x) if isinstance(x, Exception) else x for x in spec.measured(["ab", "exit", "abc"])] == [
        2,
        "unit.exiting_length: length() raised SystemExit: 3; fix the item",
        3,
    ]


def _exiting_length(item: str) -> int:
    if item == "exit":
        sys.exit(3)
    return len(item)


@pytest.mark.parametrize("name", ["unit.raise", "unit.my-task", "unit.2nd", "plain name"])
def test_any_task_name_makes_a_task_celery_can_call(name: str) -> None:
    """Celery compiles a function named after the task to check its calls: a name whose last part is
    a Python keyword or no identifier (``bad.raise``) crashed every process that imported it."""

    def upper(texts: list[str]) -> list[str]:
        return [t.upper() for t in texts]

    task = batched(upper, name=name)
    assert task.name == name and spec_for(name) is not None
    assert task.apply(args=("hi",)).get() == "HI"
    with pytest.raises(InvalidInput, match="exactly one item"):  # calls are still checked
        task.delay()


@pytest.mark.parametrize(
    ("item", "match"),
    [
        (
            {"__type__": "bytes", "__value__": "hi"},
            r"would hand your function b'hi' \(bytes\), not the dict sent",
        ),
        ([{"__type__": "decimal", "__value__": "1.5"}], r"Decimal\('1.5'\) \(Decimal\)"),
        (
            {"k": {"__type__": "datetime", "__value__": "not a date"}},
            "fails on it .ValueError: Invalid isoformat",
        ),
        ({"__type__": "no such type", "__value__": 1}, "fails on it .it knows no type 'no such type'.;"),
    ],
)
def test_delay_refuses_an_item_holding_a_dict_shaped_like_a_kombu_type_tag(item: Any, match: str) -> None:
    """The worker decodes its batch with Celery's JSON, which turns such a dict into another value
    (or fails on it, failing the batch): the caller learns at the call, told to rename the keys."""
    with pytest.raises(InvalidInput, match=match) as refused:
        shout.delay(item)
    assert "a dict shaped like one of kombu's type tags" in str(refused.value)
    assert "rename the dict's keys" in str(refused.value)


def test_dicts_that_only_look_a_little_like_type_tags_travel() -> None:
    spec, settings = shout.spec, Settings()
    for item in ({"__type__": "bytes", "__value__": "hi", "third": 1}, {"__type__": "bytes"}, ["__type__"]):
        assert spec.accept([item], {}, settings) == (shout.name, item)


def test_intake_refuses_alone_a_raw_item_holding_a_type_tag_or_an_integer_past_64_bits() -> None:
    """What .delay() refuses, a raw message (send_task, another client) carries to the coordinator,
    where it is refused with the same error: the item never reaches a batch, which the worker's
    Celery JSON would fail to decode (every request in it then lost to its deadline), nor reaches the
    function as something else (bytes for the dict sent, a float for the integer)."""
    big = 123456789012345678901234567890
    out = _intake(
        [
            ("ok", message("ok", {"n": 3}, task=declared.name)),
            (
                "poison",
                message("poison", {"__type__": "datetime", "__value__": "not a date"}, task=shout.name),
            ),
            ("bytes", message("bytes", [{"__type__": "bytes", "__value__": "hi"}], task=shout.name)),
            ("big", message("big", {"n": 1, "x": big}, task=declared.name)),
            ("also-ok", message("also-ok", "hello", task=shout.name)),
        ]
    )
    assert sorted(req.id for _, req in out.admitted) == ["also-ok", "ok"] and not out.malformed
    errors = {r.id: str(r.error) for r in out.refused}
    assert errors.keys() == {"poison", "bytes", "big"}
    assert "fails on it (ValueError: Invalid isoformat string" in errors["poison"]
    assert "would hand your function b'hi' (bytes)" in errors["bytes"]
    with pytest.raises(InvalidInput) as at_delay:
        declared.delay({"n": 1, "x": big})
    assert errors["big"] == str(at_delay.value)
    assert "cannot travel as JSON unchanged (Integer exceeds 64-bit range)" in errors["big"]


def test_submit_many_inside_a_celery_task_sends_each_item_as_its_delay_there_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by the producer review: inside a task, submit_many's requests had no parent_id and did
    not inherit the task's priority, where .delay() (Celery's own send there) links them."""
    import carpool

    sent: list[tuple[Any, Any, dict[str, Any]]] = []
    monkeypatch.setattr(type(app), "current_worker_task", property(lambda self: object()))

    def apply_async(args: Any, kwargs: Any, **options: Any) -> str:
        sent.append((args, kwargs, options))
        return "sent"

    monkeypatch.setattr(shout, "apply_async", apply_async)
    assert carpool.submit_many(["a", "b"], task=shout) == ["sent", "sent"]
    assert [(args, kwargs) for args, kwargs, _ in sent] == [(["a"], {}), (["b"], {})]
    for _, _, options in sent:
        assert "priority" not in options, "None would keep Celery from inheriting the parent's"
        assert options["queue"] == "carpool.requests" and "carpool_sent_at" in options["headers"]


class _Label(str):
    pass


@pytest.mark.parametrize("item", [_Label("a"), {"score": np.float32(0.5)}, [np.str_("a")]])
def test_a_value_that_would_arrive_as_another_type_is_refused_saying_how_to_convert_it(item: Any) -> None:
    """The producer review found "pass strings" said of a str subclass, which is a string."""
    with pytest.raises(
        InvalidInput, match=r"would reach the function as another type.*str\(v\).*v\.item\(\)"
    ):
        shout.delay(item)


@pytest.mark.parametrize(
    "item", [b"bytes", {1, 2}, {"at": object()}, {"v": np.array([1.5, 2.5])}, np.datetime64("2026-01-01")]
)
def test_a_value_no_conversion_mends_is_refused_without_that_advice(item: Any) -> None:
    with pytest.raises(InvalidInput, match="cannot travel as JSON unchanged") as info:
        shout.delay(item)
    assert "another type" not in str(info.value)


class _PadsToEight:
    """A batch function that pads its batch to multiples of 8 (as pad_batch does), and says so."""

    pad_multiple = 8

    def __call__(self, items: list[Any]) -> list[Any]:
        return items


def test_a_batch_function_that_pads_has_its_lengths_rounded_up_as_its_worker_pads() -> None:
    """The reranker and classifier adapters pad to multiples of 8: counted unrounded, a batch the
    policy held to max_tokens=64 padded to 112 (found by the review of 1788106)."""
    from carpool.adapters.sequence import Classifier, Reranker

    assert Reranker.pad_multiple == Classifier.pad_multiple == 8
    spec = BatchedSpec("unit.pads8", _PadsToEight(), len, max_tokens=64, bin_edges=())
    assert spec.pad_multiple == 8
    config = task_policy_config(policy_config(Settings()), spec)
    policy = BatchPolicy(config, LatencyModel(prior_base_s=0.01, prior_per_token_s=1e-4))
    for i in range(16):
        policy.add(Request(id=f"r{i}", model=spec.name, length=9, arrival_s=0.0, deadline_s=100.0))
    plan = policy.poll(1.0, free_workers=4, free_slots=4)
    assert [(b.size, b.padded_len) for b in plan.batches] == [(4, 16)] * 4  # 4 x 16 = 64, not 7 x 9
    with pytest.raises(ValueError, match="max_tokens must be >= 8"):
        BatchedSpec("unit.pads8.small", _PadsToEight(), len, max_tokens=4)


@pytest.mark.parametrize(("multiple", "ok"), [(np.int64(8), True), (0, False), ("8", False), (True, False)])
def test_a_batch_functions_pad_multiple_is_checked_when_the_task_is_defined(multiple: Any, ok: bool) -> None:
    """A bad one passed @batched and .delay(), then stopped every coordinator with a traceback."""

    class Pads:
        pad_multiple = multiple

        def __call__(self, items: list[Any]) -> list[Any]:
            return items

    if ok:
        assert BatchedSpec("unit.pads.ok", Pads(), len).pad_multiple == 8
        return
    with pytest.raises(ValueError, match="pad_multiple must be an integer >= 1"):
        BatchedSpec("unit.pads.bad", Pads(), len)


class _Colour(enum.StrEnum):
    RED = "red"


class _Level(enum.IntEnum):
    HIGH = 1


@pytest.mark.parametrize(
    ("item", "said"),
    [
        (
            uuid.UUID(int=1),
            r"a UUID \(00000000-0000-0000-0000-000000000001\) would reach the function as a str",
        ),
        (
            {"colour": [_Colour.RED]},
            r"an Enum member .* would reach the function as its value; pass v\.value",
        ),
        (_Level.HIGH, "an Enum member"),
    ],
)
def test_a_uuid_or_an_enum_member_is_refused_saying_what_it_would_arrive_as(item: Any, said: str) -> None:
    """orjson writes them natively, so they passed and arrived as a str or a plain value, where a
    Celery worker's kombu JSON gives a UUID back (found by the review of the conversion advice)."""
    with pytest.raises(InvalidInput, match=said) as info:
        shout.delay(item)
    assert str(info.value).count("would reach the function") == 1

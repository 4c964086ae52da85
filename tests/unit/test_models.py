"""Models: tokenization, padding invariance, user models by import path."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from carpool.errors import UnknownModel
from carpool.gpu_worker.runner import loaded_model, pad, run_isolating, run_padded
from carpool.models import get_model
from tests.tolerances import VECTOR_ATOL


def test_pad_to_multiple_of_8_with_mask() -> None:
    ids, mask = pad([[1, 2, 3], [4] * 9], [3, 9], pad_id=0)
    assert ids.shape == (2, 16) and mask.shape == (2, 16)
    assert ids[0, :4].tolist() == [1, 2, 3, 0]
    assert mask.sum(axis=1).tolist() == [3, 9]


def test_toy_output_does_not_depend_on_batch_or_padding() -> None:
    model = loaded_model("toy")
    texts = ["short one", "a much longer text " * 30, "mid length text here"]
    ids = model.encode(texts)
    alone = run_padded(model, [ids[0]], [len(ids[0])])[0]
    together = run_padded(model, ids, [len(i) for i in ids])[0]
    assert np.allclose(alone, together, atol=VECTOR_ATOL)


def test_minilm_truncates_to_its_window_like_sentence_transformers() -> None:
    model = get_model("minilm")
    ids = model.encode(["word " * 1000, "hi"])
    assert len(ids[0]) == 256 == model.max_length
    assert ids[1][0] == 101 and ids[1][-1] == 102  # [CLS] ... [SEP]


def test_minilm_encode_gives_the_tokenizers_plain_ids_on_the_accelerator_mix() -> None:
    """``encode`` cuts long texts and uses the offsets-free batch call: the ids must be exactly what a
    plain ``encode_batch`` of each whole text gives under the same truncation."""
    from carpool.models.minilm import MiniLM
    from carpool.tools.workload import ACCELERATOR_MIX, mixed_texts

    model = MiniLM()
    texts = [*mixed_texts(300, 7, ACCELERATOR_MIX), "é" * 3000, "naïve café " * 200, ""]
    ids = model.encode(texts)
    plain = [e.ids for e in model._get_tokenizer().encode_batch(texts, add_special_tokens=True)]
    assert ids == plain
    assert any(len(row) == model.max_length for row in ids)  # the mix reaches the window


def test_minilm_forward_works_outside_inference_mode_and_returns_unit_float32_rows() -> None:
    """The model protocol is callable directly (scripts, notebooks): no autograd state may leak out."""
    model = get_model("minilm")
    model.load("cpu")
    texts = ["a short text", "a longer text about batching requests of different lengths"]
    ids, mask = pad(model.encode(texts), [len(i) for i in model.encode(texts)], pad_id=model.pad_id)
    rows = model.forward(ids, mask)
    assert isinstance(rows, np.ndarray) and rows.dtype == np.float32 and rows.shape == (2, 384)
    assert np.allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-5)
    # On a CPU the forward is synchronous: nothing to launch ahead, the worker runs it as it is.
    assert getattr(model, "launch", None) is None


@pytest.mark.gpu
def test_on_cuda_minilm_launches_asynchronously_and_collects_what_forward_gives() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = get_model("minilm")
    model.load("cuda")
    texts = ["a short text", "a longer text about batching requests of different lengths"]
    encoded = model.encode(texts)
    ids, mask = pad(encoded, [len(i) for i in encoded], pad_id=model.pad_id)
    launch = model.launch  # type: ignore[attr-defined]
    first, second = launch(ids, mask), launch(ids[:1], mask[:1])  # two queued on the stream
    expected = model.forward(ids, mask)
    assert np.allclose(first(), expected, atol=VECTOR_ATOL)
    assert np.allclose(second(), expected[:1], atol=VECTOR_ATOL)


class Exploding:
    """A user model that fails on any text containing 'boom'."""

    max_length = 16
    pad_id = 0
    needs_token_ids = True

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [[666 if w == "boom" else 1 for w in t.split()][:16] or [1] for t in texts]

    def load(self, device: str) -> None:
        pass

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> list[int]:
        if (input_ids == 666).any():
            raise ValueError("cannot digest boom")
        return [int(n) for n in attention_mask.sum(axis=1)]


def test_user_model_by_import_path_and_failures_isolated_by_splitting() -> None:
    model = get_model(f"{__name__}:Exploding")
    texts = ["a b", "boom", "c d e", "f", "x boom y", "g h"]
    ids = model.encode(texts)
    outcomes = run_isolating(model, ids, [len(i) for i in ids])
    assert [ok for ok, _ in outcomes] == [True, False, True, True, False, True]
    assert [out for ok, out in outcomes if ok] == [2, 3, 1, 2]
    assert all("boom" in str(out) for ok, out in outcomes if not ok)


def test_unknown_model_names_the_choices() -> None:
    with pytest.raises(UnknownModel, match="minilm, toy, null"):
        get_model("nonsense")
    with pytest.raises(UnknownModel, match="cannot be imported"):
        get_model("no_such_package.mod:Thing")


class LacksTwoMembers:
    """A user model without ``pad_id`` and ``needs_token_ids``: each request failed as InvalidInput."""

    max_length = 16

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [[1] for _ in texts]

    def load(self, device: str) -> None:
        pass

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> list[int]:
        return [1] * len(input_ids)


def test_a_user_model_lacking_a_member_of_batchmodel_is_a_configuration_error_naming_it() -> None:
    from carpool.errors import ConfigError

    with pytest.raises(ConfigError, match=r"lacks pad_id, needs_token_ids: see carpool.models.base"):
        get_model(f"{__name__}:LacksTwoMembers")


class RunsOutOfMemory:
    """A model whose batches of more than 4 rows do not fit in (pretend) accelerator memory."""

    max_length = 16
    pad_id = 0
    needs_token_ids = True
    calls: list[int] = []

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return [[1] * len(t.split()) or [1] for t in texts]

    def load(self, device: str, *, autocast_bf16: bool = False) -> None:
        pass

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> list[int]:
        import torch

        self.calls.append(len(input_ids))
        if len(input_ids) > 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return [int(n) for n in attention_mask.sum(axis=1)]


def test_out_of_memory_splits_and_retries_smaller_until_it_fits() -> None:
    model = RunsOutOfMemory()
    texts = [" ".join(["w"] * (i + 1)) for i in range(16)]
    ids = model.encode(texts)
    outcomes = run_isolating(model, ids, [len(i) for i in ids])
    assert all(ok for ok, _ in outcomes)
    assert [out for _, out in outcomes] == [i + 1 for i in range(16)]
    assert model.calls[0] == 16 and max(model.calls[1:]) <= 8 and 4 in model.calls


class RecordsItsLoad(Exploding):
    """A user model that keeps where it was loaded and with what precision."""

    loads: list[tuple[str, bool]] = []

    def load(self, device: str, *, autocast_bf16: bool = False) -> None:
        RecordsItsLoad.loads.append((device, autocast_bf16))


def test_infer_run_as_plain_celery_runs_it_loads_the_model_as_carpools_worker_would() -> None:
    """``carpool.infer``'s body (a plain Celery worker's, eager mode's, the bench's baseline) loads
    its model where ``CARPOOL_DEVICE`` and ``CARPOOL_AUTOCAST_BF16`` say, not always on the CPU in fp32."""
    from carpool.celery_edge.app import app
    from carpool.gpu_worker import runner
    from carpool.tasks import infer

    name = f"{__name__}:RecordsItsLoad"
    RecordsItsLoad.loads.clear()
    saved = app.carpool.settings
    app.carpool.settings = saved.model_copy(update={"models": (*saved.models, name), "autocast_bf16": True})
    try:
        assert infer.run("a b c", model=name) == 3
    finally:
        app.carpool.settings = saved
        runner._loaded.pop(name, None)
    assert RecordsItsLoad.loads == [(runner.pick_device(saved.device), True)]


def test_the_bench_measures_its_offline_ceiling_on_the_model_as_a_worker_loads_it_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from carpool.gpu_worker import runner
    from carpool.tools.bench.offline import load_model
    from carpool.tools.bench.report import machine_info

    name = f"{__name__}:RecordsItsLoad"
    monkeypatch.setenv("CARPOOL_AUTOCAST_BF16", "true")
    monkeypatch.setenv("CARPOOL_DEVICE", "cpu")
    RecordsItsLoad.loads.clear()
    try:
        load_model(name)
    finally:
        runner._loaded.pop(name, None)
    assert RecordsItsLoad.loads == [("cpu", True)]  # a bf16 run's ceiling is bf16 too
    machine = machine_info()
    assert (machine["carpool_device"], machine["autocast_bf16"], machine["gpu"]) == ("cpu", True, None)


@pytest.mark.parametrize("setting", ["cuda", "cuda:0", "cuda:1"])
def test_a_cuda_device_torch_does_not_see_is_a_configuration_error_naming_the_setting(
    setting: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from carpool.errors import ConfigError
    from carpool.gpu_worker.runner import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=rf"^an adapter's device={setting} but torch sees no CUDA device"):
        pick_device(setting, "an adapter's device")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # one device, as on a 1-GPU box
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    if setting == "cuda:1":
        with pytest.raises(ConfigError, match=r"sees 1 CUDA device\(s\), cuda:0 to cuda:0"):
            pick_device(setting, "an adapter's device")
    else:
        assert pick_device(setting, "an adapter's device") == setting


def test_only_an_out_of_memory_error_empties_the_accelerator_cache_before_a_split(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from carpool.gpu_worker import runner

    emptied: list[str] = []
    monkeypatch.setattr(runner, "_free_accelerator_memory", lambda: emptied.append("emptied"))

    def fails(kind: type[Exception]) -> Any:
        def call(items: list[str], lengths: list[int]) -> list[str]:
            if "bad" in items:
                raise kind("no")
            return items

        return call

    runner.run_call_isolating(fails(ValueError), ["a", "bad"], [1, 1], inference=False)
    assert emptied == []
    runner.run_call_isolating(fails(torch.cuda.OutOfMemoryError), ["a", "bad"], [1, 1], inference=False)
    assert emptied == ["emptied"]


class NeedsArguments:
    def __init__(self, path: str) -> None:
        self.path = path


def test_a_user_model_that_cannot_be_built_with_no_arguments_is_a_configuration_error_naming_it() -> None:
    from carpool.errors import ConfigError

    with pytest.raises(ConfigError, match=r"could not be built: NeedsArguments\(\) raised TypeError: .*path"):
        get_model(f"{__name__}:NeedsArguments")

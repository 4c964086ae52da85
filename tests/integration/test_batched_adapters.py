"""Built-in adapters as @batched tasks through real processes: a reranker's scores and a classifier's
labels equal the same adapters run in-process, and the models load on the worker only."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import Processes, start_stack
from tests.tolerances import VECTOR_ATOL
from tests.unit.test_adapters import PAIRS, TEXTS, save_classifier


@pytest.fixture()
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    save_classifier(tmp_path / "reranker", num_labels=1)
    labels = {0: "negative", 1: "positive"}
    save_classifier(tmp_path / "classifier", id2label=labels, label2id={v: k for k, v in labels.items()})
    monkeypatch.setenv("CARPOOL_TEST_MODELS_DIR", str(tmp_path))
    return tmp_path


def test_reranker_and_classifier_served_side_by_side(processes: Processes, models: Path) -> None:
    import carpool
    from carpool.adapters import classifier, reranker

    sys.modules.pop("tests.integration.rerank_tasks", None)
    tasks = importlib.import_module("tests.integration.rerank_tasks")
    start_stack(
        processes,
        CARPOOL_IMPORTS="tests.integration.rerank_tasks",
        CARPOOL_TEST_MODELS_DIR=str(models),
        CARPOOL_MODEL="toy",
    )
    pairs = PAIRS * 5
    scores = carpool.gather(carpool.submit_many(pairs, task=tasks.rerank), timeout=120)
    labels = carpool.gather(carpool.submit_many(TEXTS, task=tasks.classify), timeout=120)

    expected_scores = reranker(models / "reranker")(pairs)
    assert scores == pytest.approx(expected_scores, abs=VECTOR_ATOL)
    expected_labels = classifier(models / "classifier")(TEXTS)
    assert [x["label"] for x in labels] == [x["label"] for x in expected_labels]
    for got, want in zip(labels, expected_labels, strict=True):
        assert got["scores"] == pytest.approx(want["scores"], abs=VECTOR_ATOL)
    # The producer built the task objects but never loaded their models: the worker did.
    assert tasks.rerank.spec.fn._model is None and tasks.classify.spec.fn._model is None

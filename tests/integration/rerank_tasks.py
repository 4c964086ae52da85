"""A reranker and a classifier served as @batched tasks, over tiny models the test builds
(CARPOOL_IMPORTS=tests.integration.rerank_tasks; the directory in CARPOOL_TEST_MODELS_DIR)."""

from __future__ import annotations

import os
from pathlib import Path

from carpool import batched
from carpool.adapters import classifier, reranker

MODELS = Path(os.environ.get("CARPOOL_TEST_MODELS_DIR", "/nonexistent"))

rerank = batched(reranker(MODELS / "reranker"), name="tests.rerank", max_batch=16)
classify = batched(classifier(MODELS / "classifier"), name="tests.classify")

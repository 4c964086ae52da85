"""The built-in task of ``carpool bench --task reranker``: the cross-encoder in ``--model-dir`` as a
``@batched`` task. The bench passes the directory to itself and to every process it starts in
``CARPOOL_BENCH_MODEL_DIR``, so each builds the same task when it imports this module."""

from __future__ import annotations

import os

from carpool.adapters import reranker
from carpool.errors import ConfigError
from carpool.tasks import batched
from carpool.tools.bench.task_mode import MODEL_DIR_ENV, RERANK_TASK


def _model_dir() -> str:
    path = os.environ.get(MODEL_DIR_ENV)
    if not path:
        raise ConfigError(
            f"{MODEL_DIR_ENV} is not set: run carpool bench --task reranker --model-dir DIR "
            "(a local cross-encoder directory)"
        )
    return path


rerank = batched(reranker(_model_dir()), name=RERANK_TASK)

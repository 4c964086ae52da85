"""Built-in batch functions for what people batch most, each over a local model directory.

``embedding(path)`` (sentence-transformers, text -> floats), ``reranker(path)`` ([query, passage] ->
score) and ``classifier(path)`` (text -> label and scores). Each has ``length(item)`` for the
coordinator (no torch), ``load()`` for the worker (once per process) and ``adapter(items) -> outputs``.
"""

from __future__ import annotations

from carpool.adapters.base import Adapter
from carpool.adapters.embedding import Embedding, embedding
from carpool.adapters.sequence import Classifier, Reranker, classifier, reranker

__all__ = ["Adapter", "Classifier", "Embedding", "Reranker", "classifier", "embedding", "reranker"]

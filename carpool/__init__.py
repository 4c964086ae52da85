"""carpool: call a model with Celery's ``.delay()``; a coordinator turns the requests into
length-binned, tightly padded micro-batches that GPU workers run.

Producer API: ``from carpool.tasks import infer``; ``@carpool.batched`` makes any batch function a
task; in bulk, ``carpool.submit_many(texts)`` and
``carpool.gather(results)`` (or ``await carpool.gather_async(results)``). Importing carpool never
imports torch.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers and IDEs
    from carpool.producer.gather import gather, gather_async
    from carpool.producer.submit import submit_many
    from carpool.tasks import batched

__version__ = "0.1.0"

# Lazy, so `import carpool` stays free of Celery (and never imports torch).
_LAZY = {
    "submit_many": "carpool.producer.submit",
    "gather": "carpool.producer.gather",
    "gather_async": "carpool.producer.gather",
    "batched": "carpool.tasks",
}

__all__ = ["__version__", "batched", "gather", "gather_async", "submit_many"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'carpool' has no attribute {name!r}")
    return getattr(import_module(module), name)

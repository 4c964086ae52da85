"""carpool: call a model with Celery's ``.delay()``; a coordinator turns the requests into
length-binned, tightly padded micro-batches that GPU workers run.

Producer API: ``from carpool.tasks import infer``; in bulk, ``carpool.submit_many(texts)`` and
``carpool.gather(results)``. Importing carpool never imports torch.
"""

from typing import Any

__version__ = "0.1.0"

_CLIENT = ("submit_many", "gather", "gather_async")


def __getattr__(name: str) -> Any:
    # Lazy, so `import carpool` stays free of Celery (and never imports torch).
    if name in _CLIENT:
        from carpool.producer import client

        return getattr(client, name)
    raise AttributeError(f"module 'carpool' has no attribute {name!r}")

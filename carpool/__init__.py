"""carpool: call a model with Celery's ``.delay()``; a coordinator turns the requests into
length-binned, tightly padded micro-batches that GPU workers run.

Producer API: ``from carpool.tasks import infer``. Importing carpool never imports torch.
"""

__version__ = "0.1.0"

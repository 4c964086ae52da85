"""GPU workers: Celery workers on the batch queue, one process per device.

``runner`` pads a batch and runs the model (splitting a failing batch to isolate the culprit);
``task`` is the Celery side: claim the batch's requests, run, store each request's result under its
own task id, acknowledge, and report the batch's timing to the coordinator.
"""

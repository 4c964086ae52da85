"""GPU workers: Celery workers on the batch queue, one process per device.

``runner`` pads a batch and runs the model (splitting a failing batch to isolate the culprit);
``runtime`` is a worker's work per batch: claim the batch's requests, run, store each request's
result under its own task id, acknowledge, and report the batch's timing to the coordinator;
``task`` registers that as the ``carpool.run_batch`` Celery task.
"""

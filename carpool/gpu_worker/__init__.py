"""GPU workers: Celery workers on the batch queue, one process per device.

``runner`` pads a batch and runs the model (splitting a failing batch to isolate the culprit);
``runtime`` is a worker's work per batch: claim the batch's requests, run, store each request's
result under its own task id, acknowledge, and report the batch's timing to the coordinator;
``claimed`` sorts a batch by what its claim found; ``finish`` is what surrounds the store (chain
failures, retries while Redis restarts, refused writes counted, links applied after it);
``serving`` says which tasks and batch queues a worker serves; ``stage`` holds the threads that
overlap the device: one runs batches while the Celery thread claims the next, one stores results
while the device runs the next; ``task`` registers that as the ``carpool.run_batch`` Celery task.
"""

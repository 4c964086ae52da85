"""The coordinator: drains Celery request messages from Redis into length-binned micro-batches.

``service`` runs the loop that feeds the pure policy in ``carpool.batching`` and hands its batches to
GPU workers as Celery tasks; ``metrics`` serves its Prometheus metrics.
"""

"""The Celery edge: the app, task messages in and out, events for Flower, the result backend."""

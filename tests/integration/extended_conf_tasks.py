"""A task module that turns on a Celery setting carpool cannot honour (CARPOOL_IMPORTS of the test
that workers refuse it at start)."""

from carpool.celery_app import app

app.conf.result_extended = True

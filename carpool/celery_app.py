"""The carpool Celery app, where Celery users expect it: ``celery -A carpool.celery_app flower``.

It lives in :mod:`carpool.celery_edge.app`; this module only names it.
"""

from carpool.celery_edge.app import app, create_app, settings_of

__all__ = ["app", "create_app", "settings_of"]

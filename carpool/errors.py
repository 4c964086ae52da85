"""Every error carpool raises, as one small tree a caller can catch.

These classes cross process boundaries: a worker stores one as a request's failure and Celery rebuilds
it on the producer's ``AsyncResult.get()`` from its module and class name, so keep their constructors
to a single message argument.
"""

from __future__ import annotations


class CarpoolError(Exception):
    """Base class of every carpool error."""


class ConfigError(CarpoolError):
    """Raised when a setting has a value carpool cannot run with."""


class InvalidInput(CarpoolError, ValueError):
    """Raised when a request's payload is not something the model can take (client error)."""


class UnknownModel(InvalidInput):
    """Raised when a request names a model that is not configured."""


class InputTooLong(InvalidInput):
    """Raised when a text is over the size limit, or over the model's window with truncation off."""


class DeadlineExceeded(CarpoolError):
    """Raised when a request's deadline passed before it could run."""


class QueueFull(CarpoolError):
    """Raised when more requests wait than ``CARPOOL_MAX_PENDING`` allows; retry later."""


class ModelError(CarpoolError):
    """Raised when the model failed on a request (server error); the message carries the cause."""


class MalformedMessage(CarpoolError):
    """Raised when a message in the request queue is not a carpool request (it is dead-lettered)."""

"""Every error carpool raises, as one small tree a caller can catch.

These classes cross process boundaries: a worker stores one as a request's failure and Celery rebuilds
it on the producer's ``AsyncResult.get()`` from its module and class name, so keep their constructors
to a single message argument.
"""

from __future__ import annotations

import sys
from typing import Any


class CarpoolError(Exception):
    """Base class of every carpool error."""


class ConfigError(CarpoolError):
    """Raised when a setting has a value carpool cannot run with."""


CONFIG_ERROR_EXIT = 2  # the exit status of a carpool process stopped by a ConfigError


class InvalidInput(CarpoolError, ValueError):
    """Raised when a request's payload is not something the model can take (client error)."""


class UnknownModel(InvalidInput):
    """Raised when a request names a model that is not configured."""


class InputTooLong(InvalidInput):
    """Raised when a text is over the size limit, or over the model's window with truncation off."""


class UnsupportedOption(InvalidInput, TypeError):
    """Raised at ``.delay()`` for a Celery option a carpool task cannot honour; the message says why."""


class DeadlineExceeded(CarpoolError):
    """Raised when a request's deadline passed before it could run."""

    @classmethod
    def waited(cls, late_s: float, where: str, sent_s_ago: float | None = None) -> DeadlineExceeded:
        """The error for a request ``late_s`` past its deadline ``where`` it was found (a phrase),
        sent ``sent_s_ago`` by its producer's clock."""
        sent = ""
        if sent_s_ago is not None:
            # Deadlines count from the producer's clock: one running behind makes fresh requests late.
            sent = (
                f" (sent {sent_s_ago:.3f}s ago by its producer's clock: if it was sent just now, that"
                " clock runs behind this host's; synchronise them)"
            )
        return cls(
            f"deadline passed {late_s:.3f}s ago {where}, before a worker could run it{sent}; "
            "raise expires= or CARPOOL_DEFAULT_DEADLINE_S, or add workers"
        )


class QueueFull(CarpoolError):
    """Raised when more requests wait than ``CARPOOL_MAX_PENDING`` allows; retry later."""


class ModelError(CarpoolError):
    """Raised when the model failed on a request (server error); the message carries the cause."""


class DeviceLost(ModelError):
    """The accelerator failed in a way that leaves it unusable to this process (a CUDA error: a
    device-side assert, an illegal memory access, an uncorrectable ECC error): every later call
    on it would fail too. The batch's requests fail with it and the worker stops, for its
    supervisor to start it again with a fresh device context."""


def device_lost(raised: BaseException) -> bool:
    """Whether ``raised``, out of a batch function, is a CUDA runtime error that torch cannot recover
    from in this process (``torch.AcceleratorError``; before torch 2.8, which lacks that class, a
    RuntimeError saying "CUDA error"). Not one: running out of memory (torch raises
    ``OutOfMemoryError``, and smaller batches fit), and a cuBLAS or cuSPARSE status, which torch
    also words "CUDA error: CUBLAS_STATUS_..." but which leaves the context usable
    (``CUBLAS_STATUS_ALLOC_FAILED`` is running out of memory too)."""
    torch = sys.modules.get("torch")  # a function that never imported torch ran on no CUDA device
    if torch is None:
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None:
        return isinstance(raised, accelerator_error)
    text = str(raised)
    return (
        isinstance(raised, RuntimeError)
        and text.startswith("CUDA error")
        and not any(library in text for library in ("CUBLAS_STATUS_", "CUSPARSE_STATUS_", "CUSOLVER_STATUS_"))
    )


class MalformedMessage(CarpoolError):
    """Raised when a message in the request queue is not a carpool request (it is dead-lettered)."""


class RefusedMessage(MalformedMessage):
    """Raised when a request message names its task and id but carries what carpool cannot honour
    (an eta or expires no datetime holds, a task no coordinator serves): its caller is answered with
    the reason, as :class:`InvalidInput`, instead of the message being dead-lettered. ``task_id``
    is the message's id; ``task``, ``links`` and ``inbox`` say where that answer goes on to. Never
    stored as a result itself."""

    def __init__(
        self,
        message: str,
        *,
        task_id: str | None = None,
        task: str | None = None,
        links: Any = None,
        inbox: str | None = None,
    ) -> None:
        super().__init__(message)
        self.task_id = task_id
        self.task = task
        self.links = links
        self.inbox = inbox


class WireError(CarpoolError):
    """Raised when a message between a coordinator and a worker lacks what its schema requires."""


class WireVersionMismatch(WireError):
    """Raised when a message between a coordinator and a worker was written by another carpool release."""


class SubmitInterrupted(CarpoolError):
    """Raised when a chunked ``submit_many`` lost Redis part-way.

    ``results`` holds the AsyncResults of the requests already sent, in order (they will run); the
    payloads after them were not sent. Raised in the producer only, never stored as a result.
    """

    results: list[Any]

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.results = []


class NotReplicated(CarpoolError):
    """Raised at ``.delay()`` / ``submit_many`` when fewer Redis replicas than ``CARPOOL_WAIT_REPLICAS``
    confirmed the request within ``CARPOOL_WAIT_TIMEOUT_S``.

    The request is on the master and will run unless the master fails before a replica has it.
    ``results`` holds the AsyncResults of the requests sent (resend them only if running twice is
    harmless: a resent request is another task). Raised in the producer only, never stored as a result.
    """

    results: list[Any]

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.results = []


def described(exc: BaseException) -> str:
    """``"Type: message"`` (``"Type"`` where the message is empty) of an exception a user's code
    raised, for the error carpool stores in its place; never raising, since a message that cannot be
    read (a ``__str__`` that raises) must not cost the other requests of the batch their answers."""
    try:
        message = str(exc)
        return f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    except Exception:
        return f"{type(exc).__name__} (its message could not be read)"


def stops_the_process(raised: BaseException) -> bool:
    """Whether ``raised``, out of a user's model, task or length function, must go on up and stop
    the process: Ctrl-C, and Celery's WorkerShutdown / WorkerTerminate (the worker stopping;
    subclasses of SystemExit). Anything else fails only the items it was raised for: a plain
    ``sys.exit()``, an ``asyncio.CancelledError`` out of a function's ``asyncio.run`` or a
    ``GeneratorExit`` (carpool closes no generator of a user's) must not stop a coordinator or
    worker, and then the next one its requests reach through lease recovery."""
    if isinstance(raised, KeyboardInterrupt):
        return True
    return isinstance(raised, SystemExit) and type(raised) is not SystemExit


def user_failure(raised: BaseException) -> Exception:
    """The failure that ``raised`` (not one that :func:`stops_the_process`) stands for: an
    Exception as it is; ``sys.exit()`` and another BaseException as a ModelError saying what to do
    instead (Celery stores and raises Exceptions)."""
    if isinstance(raised, Exception):
        return raised
    if type(raised) is SystemExit:
        happened = f"called sys.exit({raised.code!r}) (raised SystemExit)"
    else:
        happened = f"raised {described(raised)}, a BaseException that is not an Exception"
    return ModelError(
        f"the batch function {happened}; raise an Exception for the items that cannot be run instead, and the"
        " others run on"
    )

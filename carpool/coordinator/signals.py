"""Stop signals for a process whose main loop waits on a ``threading.Event``.

A Python signal handler runs on the main thread between two bytecodes, which may be inside that
thread's own ``Event.wait()`` while it holds the event's internal lock: ``Event.set()`` there takes
the same non-reentrant lock and the process hangs for good. So the handler only queues the signal
(``SimpleQueue.put`` is reentrant) and a thread of its own sets the event.
"""

from __future__ import annotations

import queue
import signal
import threading
from collections.abc import Callable, Iterable
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def set_on_signals(
    event: threading.Event,
    signals: Iterable[int] = STOP_SIGNALS,
    on_signal: Callable[[int], None] | None = None,
) -> None:
    """Set ``event`` whenever one of ``signals`` arrives, after calling ``on_signal`` with its number
    (on the relaying thread, where logging is safe). Call from the main thread."""
    received: queue.SimpleQueue[int] = queue.SimpleQueue()

    def relay() -> None:
        while True:
            signum = received.get()
            if on_signal is not None:
                on_signal(signum)
            event.set()

    def handler(signum: int, _frame: FrameType | None) -> None:
        received.put(signum)

    threading.Thread(target=relay, name="carpool-signals", daemon=True).start()
    for signum in signals:
        signal.signal(signum, handler)

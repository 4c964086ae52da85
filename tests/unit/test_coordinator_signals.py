"""The coordinator's stop signals: a signal landing inside the loop's own wait still stops it."""

from __future__ import annotations

import select
import signal
import subprocess
import sys

import pytest

# A loop that, like the coordinator's with requests held and no worker, spins through the stop
# event's wait; each signal must set the event (the loop then clears it and reports the signal).
CHILD = """
import sys, threading
from carpool.coordinator.signals import set_on_signals

event = threading.Event()
heard = []
set_on_signals(event, on_signal=heard.append)
print("ready", flush=True)
while True:
    while not event.wait(0):
        pass
    event.clear()
    print(heard[-1], flush=True)
"""

SIGNALS = 300


def _line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline().strip() if ready else ""


def test_every_signal_sets_the_stop_event_even_mid_wait() -> None:
    # Setting the event in the handler itself deadlocked on about half of such signals.
    with subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert _line(proc, 30) == "ready"
            for i in range(SIGNALS):
                signum = signal.SIGINT if i == SIGNALS - 1 else signal.SIGTERM
                proc.send_signal(signum)
                got = _line(proc, 10)
                if got != str(int(signum)):
                    pytest.fail(f"signal {i + 1} of {SIGNALS} did not set the event (child printed {got!r})")
        finally:
            proc.kill()

"""``sim-v100`` / ``sim-h100``: MiniLM's tokenizer in front of a simulated accelerator.

``forward`` keeps a pretend device busy for ``a_s + b_s * padded tokens`` seconds by sleeping, so the
CPU stays free meanwhile as it does while a real GPU computes, and returns one 384-float row per
request (MiniLM's output size and type). Like a CUDA stream, the device also takes batches
asynchronously: ``launch`` queues a batch behind those already on it and returns at once; waiting
for its outputs sleeps until the device has run it. This is how carpool's own CPU cost per request is measured
in the regime where the device is fast: on a CPU machine the real model hides it.

The coefficients of the named profiles are the ones issue 11 set for the device classes they are
named after (V100-class: 0.3 ms per batch and 3.8 µs per padded token, near sentence-transformers'
published ~14,200 sentences/s for all-MiniLM-L6-v2 on a V100; H100-class: 0.2 ms and 1.25 µs):
assumptions, not measurements, since no GPU has been at hand to fit them. The simulated launch
costs the worker no host CPU, where a real eager PyTorch forward costs some per batch. Set your
own with ``CARPOOL_SIM_DEVICE=a_s,b_s`` (seconds per batch, seconds per padded token) and model
``sim``.

With ``CARPOOL_SIM_DEVICE_LOG=path`` set, every batch appends one line to that file,
``pid start end rows width`` (wall-clock seconds on the device's timeline, the padded batch's
shape), so a benchmark can tell when the device was busy (``carpool bench --accelerator``). Lines
are buffered and written every ``LOG_FLUSH_BATCHES`` batches and at interpreter exit.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from carpool.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

OUTPUT_DIM = 384  # all-MiniLM-L6-v2's embedding size
OUTPUT_ROWS = 1024  # distinct output rows, handed out in turn
DEVICE_LOG_ENV = "CARPOOL_SIM_DEVICE_LOG"
LOG_FLUSH_BATCHES = 64


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """Batch time ``a_s + b_s * padded_tokens`` of one simulated device."""

    name: str
    a_s: float
    b_s: float

    def batch_s(self, padded_tokens: int) -> float:
        return self.a_s + self.b_s * padded_tokens


PROFILES = {
    "v100": DeviceProfile("v100", a_s=0.3e-3, b_s=3.8e-6),
    "h100": DeviceProfile("h100", a_s=0.2e-3, b_s=1.25e-6),
}


def profile_from(spec: str) -> DeviceProfile:
    """A profile by name (``v100``, ``h100``) or from ``a_s,b_s`` in seconds."""
    if spec in PROFILES:
        return PROFILES[spec]
    try:
        a_text, b_text = spec.split(",")
        profile = DeviceProfile("custom", float(a_text), float(b_text))
    except ValueError:
        raise ConfigError(
            f"CARPOOL_SIM_DEVICE={spec!r}: use {' or '.join(PROFILES)}, or 'a_s,b_s' in seconds "
            "(e.g. 0.0003,0.0000038)"
        ) from None
    if profile.a_s < 0 or profile.b_s < 0:
        raise ConfigError(f"CARPOOL_SIM_DEVICE={spec!r}: both coefficients must be >= 0")
    return profile


def output_table() -> npt.NDArray[np.float32]:
    """The rows a simulated device hands out in turn: float32 unit vectors, the real model's output
    type and size, with an embedding's spread of values (one value repeated would write shorter
    JSON than a real model's rows do)."""
    import numpy as np

    table = np.random.default_rng(0).standard_normal((OUTPUT_ROWS, OUTPUT_DIM)).astype(np.float32)
    table /= np.linalg.norm(table, axis=1, keepdims=True)
    return table


class DeviceLog:
    """Appends ``pid start end rows width`` per batch to a file; buffered, so a batch costs a string
    format and an in-memory write, and the lines reach the file every ``LOG_FLUSH_BATCHES`` batches
    and at exit."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1 << 16)  # noqa: SIM115  (closed at exit)
        self._pid = os.getpid()
        self._unflushed = 0
        atexit.register(self.close)

    def record(self, start: float, end: float, rows: int, width: int) -> None:
        self._file.write(f"{self._pid} {start:.6f} {end:.6f} {rows} {width}\n")
        self._unflushed += 1
        if self._unflushed >= LOG_FLUSH_BATCHES:
            self.flush()

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()
        self._unflushed = 0

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class SimulatedDevice:
    """MiniLM's tokenization and window; a sleeping device; MiniLM-sized outputs."""

    pad_id = 0
    # The ids travel to the worker and are padded there, as MiniLM's are, though the sleep reads only
    # the batch's shape: the pipeline's CPU per request is measured as a real model would cost it.
    needs_token_ids = True
    plain_ids = True
    profile_name = ""  # empty: read CARPOOL_SIM_DEVICE

    def __init__(self) -> None:
        from carpool.models.minilm import MiniLM

        self.profile = profile_from(self.profile_name or os.environ.get("CARPOOL_SIM_DEVICE", "v100"))
        self._tokenizer_model = MiniLM()
        self.max_length: int = self._tokenizer_model.max_length
        self._rows: Any = None  # numpy, imported on load
        self._next = 0  # the first of the next forward's rows
        self._free_at = 0.0  # wall-clock time the device finishes the batches queued on it
        self._log: DeviceLog | None = None
        # Launches from two threads (a rerun after a device failure beside the next launch) queue
        # one behind the other, as on a device's stream.
        self._queue_lock = threading.Lock()

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return self._tokenizer_model.encode(texts)

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        return self._tokenizer_model.count_tokens(texts)

    def load(self, device: str) -> None:
        self._rows = output_table()
        self._next = 0
        path = os.environ.get(DEVICE_LOG_ENV)
        if path and self._log is None:
            self._log = DeviceLog(path)

    def forward(
        self, input_ids: npt.NDArray[np.int64], attention_mask: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.float32]:
        return self.launch(input_ids, attention_mask)()

    def launch(
        self, input_ids: npt.NDArray[np.int64], attention_mask: npt.NDArray[np.int64]
    ) -> Callable[[], npt.NDArray[np.float32]]:
        """Queue the batch on the device; the function returned sleeps until the device has run it."""
        import numpy as np

        rows, width = attention_mask.shape
        with self._queue_lock:
            start = max(time.time(), self._free_at)  # behind whatever the device still runs
            end = self._free_at = start + self.profile.batch_s(rows * width)
            if self._log is not None:
                self._log.record(start, end, rows, width)
            first, self._next = self._next, (self._next + rows) % OUTPUT_ROWS
        out: npt.NDArray[np.float32] = self._rows.take(np.arange(first, first + rows) % OUTPUT_ROWS, axis=0)

        def collect() -> npt.NDArray[np.float32]:
            left = end - time.time()
            if left > 0:
                time.sleep(left)
            return out

        return collect


class V100(SimulatedDevice):
    profile_name = "v100"


class H100(SimulatedDevice):
    profile_name = "h100"

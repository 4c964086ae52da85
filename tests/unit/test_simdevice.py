"""The simulated accelerator: its time rule, its profiles and MiniLM-shaped outputs."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import numpy as np
import pytest

from carpool.errors import ConfigError
from carpool.models import get_model
from carpool.models.simdevice import PROFILES, SimulatedDevice, profile_from


def test_profiles_and_custom_coefficients() -> None:
    assert profile_from("v100") is PROFILES["v100"]
    custom = profile_from("0.001,0.00001")
    assert custom.batch_s(100) == pytest.approx(0.001 + 0.001)
    for bad in ("a100", "1,2,3", "-1,0"):
        with pytest.raises(ConfigError, match="CARPOOL_SIM_DEVICE"):
            profile_from(bad)


def test_forward_sleeps_for_the_device_time_and_returns_minilm_sized_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CARPOOL_SIM_DEVICE", "0.02,0.0")
    model = SimulatedDevice()
    model.load("cpu")
    ids = model.encode(["a short text", "a somewhat longer text with more words in it"])
    assert ids[0][0] == 101 and ids[0][-1] == 102  # MiniLM's [CLS] ... [SEP]
    # Its ids travel to the worker and are padded there, as MiniLM's: the pipeline costs what it would.
    assert model.needs_token_ids and model.plain_ids and all(type(i) is int for row in ids for i in row)
    mask = np.ones((2, 16), dtype=np.int64)
    started = time.perf_counter()
    rows = model.forward(mask, mask)
    assert time.perf_counter() - started >= 0.02
    assert isinstance(rows, np.ndarray) and rows.shape == (2, 384) and rows.dtype == np.float32  # MiniLM's
    assert float((rows[0].astype(np.float64) ** 2).sum()) == pytest.approx(1.0, rel=1e-5)
    again = model.forward(mask, mask)  # each row its own vector, as a model's rows are
    assert len({row.tobytes() for row in [*rows, *again]}) == 4
    assert np.abs(rows).min() < np.abs(rows).max() / 10  # values spread as an embedding's are


def test_named_profiles_are_builtin_models() -> None:
    assert get_model("sim-h100").profile is PROFILES["h100"]  # type: ignore[attr-defined]
    assert get_model("sim-v100").max_length == 256


def test_device_log_records_each_forward_when_asked(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from carpool.models.simdevice import DEVICE_LOG_ENV
    from carpool.tools.bench.device import read_device_log

    log = tmp_path / "device.log"
    monkeypatch.setenv("CARPOOL_SIM_DEVICE", "0.001,0.0")
    monkeypatch.setenv(DEVICE_LOG_ENV, str(log))
    model = SimulatedDevice()
    model.load("cpu")
    assert model._log is not None
    mask = np.ones((3, 24), dtype=np.int64)
    before = time.time()
    model.forward(mask, mask)
    model.forward(mask[:1], mask[:1])
    model._log.close()  # what interpreter exit does
    forwards = read_device_log(log)
    assert [(f.rows, f.width) for f in forwards] == [(3, 24), (1, 24)]
    assert all(before <= f.start < f.end for f in forwards)


def test_no_device_log_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from carpool.models.simdevice import DEVICE_LOG_ENV

    monkeypatch.delenv(DEVICE_LOG_ENV, raising=False)
    model = SimulatedDevice()
    model.load("cpu")
    assert model._log is None


BATCH_S = 1.0  # each simulated batch's device time in the launch test: a loaded host's stalls fit in half


def test_launch_queues_each_batch_behind_the_one_running_and_returns_at_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from carpool.models.simdevice import DEVICE_LOG_ENV
    from carpool.tools.bench.device import read_device_log

    log = tmp_path / "device.log"
    monkeypatch.setenv("CARPOOL_SIM_DEVICE", f"{BATCH_S},0.0")
    monkeypatch.setenv(DEVICE_LOG_ENV, str(log))
    model = SimulatedDevice()
    model.load("cpu")
    mask = np.ones((2, 16), dtype=np.int64)
    started = time.perf_counter()
    first = model.launch(mask, mask)
    second = model.launch(mask[:1], mask[:1])
    # Bounds half a batch wide: only a launch that waited, or two batches run side by side, miss them.
    assert time.perf_counter() - started < BATCH_S / 2, "launching does not wait for the device"
    rows = first()
    first_back = time.perf_counter() - started
    assert rows.shape == (2, 384) and BATCH_S <= first_back < 1.5 * BATCH_S
    assert second().shape == (1, 384)
    assert time.perf_counter() - started >= 2 * BATCH_S, "the second batch ran after the first, not beside it"
    assert model._log is not None
    model._log.close()
    a, b = read_device_log(log)
    # The log keeps microseconds: start and end are each rounded to 1e-6 s.
    assert b.start == pytest.approx(a.end, abs=3e-6), "queued: the device starts it as the first ends"
    assert a.end - a.start == pytest.approx(BATCH_S, abs=3e-6) == b.end - b.start


def test_launches_from_several_threads_queue_one_behind_another(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A rerun after a device failure may launch beside the next batch: each launch still queues
    behind the others, never beside them, and takes rows of its own."""
    import threading

    from carpool.models.simdevice import DEVICE_LOG_ENV
    from carpool.tools.bench.device import read_device_log

    log = tmp_path / "device.log"
    monkeypatch.setenv("CARPOOL_SIM_DEVICE", "0.001,0.0")
    monkeypatch.setenv(DEVICE_LOG_ENV, str(log))
    model = SimulatedDevice()
    model.load("cpu")
    rule = model.profile

    class Yielding:
        """The profile's time rule, letting another thread run while a launch computes it."""

        def batch_s(self, tokens: int) -> float:
            time.sleep(0.002)
            return float(rule.batch_s(tokens))

    model.profile = Yielding()  # type: ignore[assignment]
    mask = np.ones((1, 8), dtype=np.int64)
    outputs: list[np.ndarray] = []

    def launch() -> None:
        outputs.append(model.launch(mask, mask)())

    threads = [threading.Thread(target=launch) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert model._log is not None
    model._log.close()
    runs = sorted(read_device_log(log), key=lambda r: r.start)
    assert len(runs) == 6
    assert all(b.start >= a.end - 3e-6 for a, b in itertools.pairwise(runs)), "no two batches side by side"
    assert len({o.tobytes() for o in outputs}) == 6, "each launch took rows of its own"

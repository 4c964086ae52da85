"""The chaos soak, short: about a minute of open-loop Poisson load at half capacity while a
coordinator (of two), a worker (of two) or redis-server (append-only file, fsync always) is killed
with SIGKILL every 5-10 s (the script's 10-60 s, scaled down) and started again a second later.

Afterwards every request must have been answered exactly once with the right result or failed with
a named error, nothing may be left queued or in flight, no process that was not killed may have
exited, memory must be flat after warm-up, and p99 must be back within 4x the calm lead-in's p99
within 25 s of each fault (generous: a loaded 2-core machine). The same code is ``carpool soak``;
see docs/RELIABILITY.md, "Chaos soak", for what each check means.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from carpool.tools.soak.config import FAULT_KINDS, short_config
from carpool.tools.soak.run import run_soak

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(400)
def test_a_short_chaos_soak_loses_nothing_and_recovers(tmp_path: Path) -> None:
    report = run_soak(short_config(), tmp_path, log=lambda _: None)
    counts = report["counts"]
    detail = {name: rule["detail"] for name, rule in report["invariants"].items() if not rule["ok"]}
    assert set(report["fault_kinds"]) == set(FAULT_KINDS), report["faults"]
    assert counts["accepted"] > 1000 and counts["accepted"] == counts["offered"] - sum(
        counts["refused_at_send"].values()
    )
    # Every request: answered once with the right result, or failed with a named error.
    assert counts["lost"] == 0, detail
    assert counts["wrong_result"] == 0
    assert counts["failed_unnamed"] == {} and counts["refused_at_send"] == {}
    assert counts["answered_ok"] + sum(counts["failed_named"].values()) == counts["accepted"]
    assert counts["reread_same"] == counts["accepted"], "a result changed or vanished after it was read"
    assert counts["left_queued"] == counts["left_in_flight"] == 0
    assert report["unexpected_exits"] == [], report["unexpected_exits"]
    assert report["invariants"]["memory_flat"]["ok"], detail
    assert report["invariants"]["p99_recovers"]["ok"], (detail, report["faults"])
    assert report["ok"], detail
    assert (tmp_path / "soak.json").exists() and (tmp_path / "soak.png").exists()

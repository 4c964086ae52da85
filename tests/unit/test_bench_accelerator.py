"""The pure parts of ``carpool bench --accelerator``: device capacity, the device log, busy fractions,
targets and the report's schema; the workload's accelerator mix; process-tree CPU."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from carpool.tools.bench.accelerator_report import SCHEMA, evaluate_targets, validate_report
from carpool.tools.bench.device import (
    Forward,
    busy_fractions,
    busy_summary,
    device_capacity,
    merge_intervals,
    nominal_device_s,
    pick_bucket_s,
    read_device_log,
)


def test_capacity_sorts_by_length_and_pads_each_batch_to_a_multiple_of_8() -> None:
    # Sorted: [3, 9] pads to 16 (32 tokens), [10, 17] pads to 24 (48 tokens).
    cap = device_capacity([10, 3, 17, 9], a_s=1.0, b_s=0.1, max_batch=2)
    assert cap["batches"] == 2
    assert cap["padded_tokens"] == 80 and cap["real_tokens"] == 39
    assert cap["device_s"] == pytest.approx(2 * 1.0 + 0.1 * 80)
    assert cap["texts_per_s"] == pytest.approx(4 / 10.0)
    assert cap["padding_ratio"] == pytest.approx(80 / 39)


def test_capacity_of_several_workers_is_their_devices_together() -> None:
    """Each worker process simulates a device of its own, so the ratio of N workers' throughput is
    taken against N devices."""
    one = device_capacity([10, 3, 17, 9], a_s=1.0, b_s=0.1, max_batch=2)
    three = device_capacity([10, 3, 17, 9], a_s=1.0, b_s=0.1, max_batch=2, devices=3)
    assert three["texts_per_s"] == pytest.approx(3 * one["texts_per_s"])
    assert three["device_s"] == one["device_s"] and three["devices"] == 3


def test_capacity_of_one_partial_batch_and_bad_batch_size() -> None:
    cap = device_capacity([1, 8, 9], a_s=0.0, b_s=1.0, max_batch=32)
    assert cap["batches"] == 1 and cap["padded_tokens"] == 3 * 16
    assert device_capacity([], 1.0, 1.0, 4)["texts_per_s"] == 0.0
    with pytest.raises(ValueError, match="max_batch"):
        device_capacity([1], 1.0, 1.0, 0)


def test_nominal_device_time_follows_the_time_rule() -> None:
    forwards = [Forward(1, 0.0, 1.0, 2, 8), Forward(1, 1.0, 2.0, 4, 16)]
    assert nominal_device_s(forwards, a_s=0.5, b_s=0.01) == pytest.approx(2 * 0.5 + 0.01 * (16 + 64))


def test_device_log_lines_are_read_oldest_first_and_a_torn_line_is_skipped(tmp_path: Path) -> None:
    log = tmp_path / "device.log"
    log.write_text("7 2.0 2.5 32 16\n7 1.0 1.5 8 24\nnot a line\n7 3.0 3.")
    assert read_device_log(log) == [Forward(7, 1.0, 1.5, 8, 24), Forward(7, 2.0, 2.5, 32, 16)]
    assert read_device_log(tmp_path / "absent.log") == []


def test_merge_intervals() -> None:
    assert merge_intervals([(3, 4), (0, 1), (0.5, 2), (2, 2.5), (5, 5)]) == [(0, 2.5), (3, 4)]


def test_busy_fraction_per_bucket() -> None:
    forwards = [Forward(1, 0.05, 0.15, 1, 8), Forward(1, 0.30, 0.35, 1, 8)]
    assert busy_fractions(forwards, 0.0, 0.4, 0.1) == pytest.approx([0.5, 0.5, 0.0, 0.5])
    # A shorter last bucket counts over its own length.
    assert busy_fractions(forwards, 0.0, 0.35, 0.1) == pytest.approx([0.5, 0.5, 0.0, 1.0])
    # Time outside the window is not counted.
    assert busy_fractions(forwards, 0.1, 0.2, 0.1) == pytest.approx([0.5])
    assert busy_fractions(forwards, 1.0, 1.0, 0.1) == []
    with pytest.raises(ValueError):
        busy_fractions(forwards, 0.0, 1.0, 0.0)


def test_busy_fraction_stays_within_0_and_1_with_overlaps_and_several_devices() -> None:
    overlapping = [Forward(1, 0.0, 0.08, 1, 8), Forward(1, 0.02, 0.1, 1, 8)]
    assert busy_fractions(overlapping, 0.0, 0.1, 0.1) == pytest.approx([1.0])
    two = [Forward(1, 0.0, 0.1, 1, 8), Forward(2, 0.0, 0.05, 1, 8)]
    assert busy_fractions(two, 0.0, 0.1, 0.1) == pytest.approx([0.75])
    # A device that never ran a batch logs nothing, yet it was idle all along (found by the review
    # of the bench: one busy device and one idle read "busy 1.0").
    one_of_two = [Forward(1, 0.0, 0.1, 1, 8)]
    assert busy_fractions(one_of_two, 0.0, 0.1, 0.1, devices=2) == pytest.approx([0.5])
    summary = busy_summary(one_of_two, 0.0, 0.1, devices=2)
    assert summary["devices"] == 2 and summary["overall"] == pytest.approx(0.5)


def test_busy_summary() -> None:
    forwards = [Forward(1, 10.2, 10.4, 1, 8), Forward(1, 10.5, 10.6, 1, 8), Forward(1, 5.0, 6.0, 1, 8)]
    summary = busy_summary(forwards, 10.0, 11.0, bucket_s=0.1)
    assert summary["forwards"] == 2 and summary["devices"] == 1  # the one before the run is left out
    assert summary["overall"] == pytest.approx(0.3)
    assert summary["while_working"] == pytest.approx(0.3 / 0.4)
    assert summary["first_start_s"] == pytest.approx(0.2) and summary["last_end_s"] == pytest.approx(0.6)
    assert len(summary["buckets"]) == 10 and all(0.0 <= v <= 1.0 for v in summary["buckets"])
    empty = busy_summary([], 0.0, 1.0)
    assert empty["overall"] == 0.0 and empty["while_working"] is None


def test_pick_bucket_s_gives_round_widths() -> None:
    assert pick_bucket_s(0.2) == 0.01
    assert pick_bucket_s(4.0) == 0.1
    assert pick_bucket_s(30.0) == 0.5
    assert pick_bucket_s(1e6) == 10.0


def _report(**overrides: Any) -> dict[str, Any]:
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "created_at": "2025-01-01T00:00:00+00:00",
        "machine": {"cpus": 2},
        "model": "sim-v100",
        "device": {"profile": "v100", "a_s": 3e-4, "b_s": 3.8e-6},
        "config": {},
        "workload": {},
        "capacity": {"texts_per_s": 5000.0},
        "carpool": {
            "throughput_rps": 4600.0,
            "ratio_to_capacity": 0.92,
            "wall_s": 1.3,
            "cpu_us_per_request": {
                "producer_submit": 15.0,
                "producer_gather": 20.0,
                "redis": 31.0,
                "coordinator": 200.0,
                "tokenization": 170.0,
                "coordinator_besides_tokenization": 30.0,
                "worker": 39.0,
            },
        },
        "device_busy": {"overall": 0.9, "buckets": [0.5, 1.0]},
        "pipeline": {"ratio": 16.0},
        "light": {"latency_ms": {"p50": 2.5, "p99": 12.0}},
        "targets": [],
        "plots": [],
        "errors": [],
    }
    report.update(overrides)
    return report


def test_targets_follow_the_issue() -> None:
    met = {t["name"]: t["met"] for t in evaluate_targets(_report())}
    assert met == {
        "throughput_vs_device_capacity": True,
        "cpu_us_worker": True,
        "cpu_us_coordinator_besides_tokenization": True,
        "cpu_us_redis": False,
        "cpu_us_producer_total": True,
        "null_pipeline_vs_plain_celery": True,
        "light_null_p50_ms": True,
        "light_null_p99_ms": False,
    }
    custom = _report(device={"profile": "custom", "a_s": 0.0, "b_s": 0.0}, carpool=None, pipeline=None)
    targets = {t["name"]: t for t in evaluate_targets(custom)}
    assert "throughput_vs_device_capacity" not in targets  # no target for coefficients of one's own
    assert targets["cpu_us_worker"]["met"] is None


def test_report_schema() -> None:
    assert validate_report(_report()) == []
    assert validate_report([]) == ["report is not an object"]
    assert "schema" in validate_report(_report(schema="other/1"))[0]
    assert any("[0, 1]" in p for p in validate_report(_report(device_busy={"overall": 1.2, "buckets": []})))
    broken = _report()
    del broken["carpool"]["cpu_us_per_request"]["worker"]
    assert any("worker" in p for p in validate_report(broken))
    over = {"components": {"worker": [0.5, 0.2]}, "total": [0.5, 0.2]}
    assert validate_report(_report(cpu_over_run=over)) == []
    negative = {"components": {"worker": [0.5, -0.2]}, "total": [0.5, 0.2]}
    assert any(">= 0" in p for p in validate_report(_report(cpu_over_run=negative)))
    longer = {"components": {"worker": [0.5, 0.2, 0.1]}, "total": [0.5, 0.2, 0.1]}
    assert any("more buckets" in p for p in validate_report(_report(cpu_over_run=longer)))


def test_accelerator_mix_reaches_past_the_window_and_the_default_mix_is_kept() -> None:
    from carpool.tools.workload import ACCELERATOR_MIX, LENGTH_MIX, describe, mixed_texts

    assert sum(share for share, _, _ in ACCELERATOR_MIX) == pytest.approx(1.0)
    assert describe() == "60% 3-20 words, 30% 21-80 words, 10% 81-300 words"
    assert mixed_texts(50, seed=3) == mixed_texts(50, 3, LENGTH_MIX)
    words = [len(t.split()) for t in mixed_texts(2000, seed=1, mix=ACCELERATOR_MIX)]
    assert min(words) >= 3 and max(words) <= 1800
    assert 0.01 < sum(w >= 300 for w in words) / len(words) < 0.06


def test_tree_cpu_covers_at_least_the_process_itself() -> None:
    from carpool.tools.bench.procstat import children_by_parent, cpu_snapshot, process_cpu_s, tree_cpu_s

    me = os.getpid()
    children = children_by_parent()
    assert me in children.get(os.getppid(), [])
    own = process_cpu_s(me)  # read first: this process's CPU keeps rising while the tree is read
    assert tree_cpu_s(me, children) >= own
    # This process's own figure leaves out its children (the processes a bench measures separately).
    assert cpu_snapshot({"me": me})["me"] == pytest.approx(process_cpu_s(me), abs=0.05)


def test_a_bench_s_redis_port_is_read_from_its_servers_title() -> None:
    # redis-server titles itself "redis-server <host>:<port>"; a child of another name is not it.
    from carpool.tools.bench.procstat import child_redis_port

    other = subprocess.Popen(["sleep", "5"])
    server = subprocess.Popen(["bash", "-c", "exec -a 'redis-server 127.0.0.1:6543' sleep 5"])
    try:
        deadline = time.monotonic() + 5
        while child_redis_port(os.getpid()) is None and time.monotonic() < deadline:
            time.sleep(0.01)  # until bash has exec'd under the new title
        assert child_redis_port(os.getpid()) == 6543
    finally:
        for child in (other, server):
            child.kill()
            child.wait()
    assert child_redis_port(os.getpid()) is None


def test_process_cpu_is_read_finer_than_procs_10_ms_ticks() -> None:
    """A 3 ms stretch of CPU shows as about 3 ms (ticks would give 0 or 10), and the figure agrees
    with /proc's utime + stime to within its ticks."""
    from carpool.tools.bench.procstat import _TICKS_PER_S, _stat, process_cpu_s

    me = os.getpid()
    before = process_cpu_s(me)
    spun = time.thread_time()
    while time.thread_time() - spun < 0.003:
        pass
    grew = process_cpu_s(me) - before
    assert 0.003 <= grew < 0.0099, grew  # ticks would give 0 or 0.01
    fields = _stat(me)
    ticks = (int(fields[11]) + int(fields[12])) / _TICKS_PER_S
    assert abs(process_cpu_s(me) - ticks) < 0.05


def test_profiles_name_the_model_and_custom_coefficients_go_to_the_worker() -> None:
    from carpool.errors import ConfigError
    from carpool.tools.bench.accelerator import resolve_profile

    name, profile, env = resolve_profile("H100")
    assert (name, profile.name, env) == ("sim-h100", "h100", {})
    name, profile, env = resolve_profile("0.001,0.00002")
    assert name == "sim" and (profile.a_s, profile.b_s) == (0.001, 0.00002)
    assert env == {"CARPOOL_SIM_DEVICE": "0.001,2e-05"}
    with pytest.raises(ConfigError):
        resolve_profile("a100")


def test_cpu_per_request_is_summed_by_role() -> None:
    from carpool.tools.bench.accelerator import _per_request_us

    before = {"_wall": 0.0, "carpool-coordinator": 1.0, "carpool-worker0": 2.0, "carpool-worker1": 0.0}
    before.update({"redis-server": 5.0, "producer": 1.0, "celery-noop": 0.0})
    after = {"_wall": 1.0, "carpool-coordinator": 1.2, "carpool-worker0": 2.1, "carpool-worker1": 0.1}
    after.update({"redis-server": 5.05, "producer": 9.0, "celery-noop": 0.0, "_busy": 3.0})
    assert _per_request_us(before, after, 1000) == pytest.approx(
        {"coordinator": 200.0, "worker": 200.0, "redis": 50.0}
    )

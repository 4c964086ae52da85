"""``carpool bench`` in quick mode: a well-formed report and real PNG plots. No timing assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _run_bench(out: Path, *args: str, timeout: int = 400) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARPOOL_")}
    return subprocess.run(
        [sys.executable, "-m", "carpool.tools.bench", "--model", "toy", "--quick", "--out", str(out), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _check_pngs(out: Path, names: list[str]) -> None:
    assert names, "no plots written"
    for name in names:
        data = (out / name).read_bytes()
        assert data[:8] == PNG_SIGNATURE, name
        assert len(data) > 2000, name


def test_quick_bench_writes_a_well_formed_report_and_plots(tmp_path: Path) -> None:
    from carpool.tools.bench.report import SCHEMA, validate_report

    out = tmp_path / "bench"
    proc = _run_bench(
        out, "--systems", "offline,carpool,celery", "--requests", "24", "--light", "2", "--pipeline", "60"
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert validate_report(report) == []
    assert report["schema"] == SCHEMA and report["errors"] == []
    assert report["model"] == "toy" and report["machine"]["cpus"] >= 1
    assert "words" in report["workload"]["length_distribution"]
    runs = report["runs"]
    systems = {r["system"] for r in runs}
    assert systems == {"offline", "carpool", "celery"}
    for name in ("carpool", "celery"):
        modes = [r["mode"] for r in runs if r["system"] == name]
        assert modes.count("burst") == 1 and modes.count("light") == 1
        assert modes.count("rate") == 3  # half saturation + the two quick rates
        assert any(r.get("half_saturation") for r in runs if r["system"] == name)
    for run in runs:
        assert run["failed"] == 0 and run["completed"] == run["requests"]
    carpool_burst = next(r for r in runs if r["system"] == "carpool" and r["mode"] == "burst")
    assert carpool_burst["requests"] == 24
    assert carpool_burst["batches"]["count"] >= 1 and carpool_burst["padding_ratio"] >= 1.0
    assert carpool_burst["extra"]["redis_commands_per_request"] > 0
    plain_burst = next(r for r in runs if r["system"] == "celery" and r["mode"] == "burst")
    assert plain_burst["batches"]["sizes"] == {"1": 24}
    assert {r["system"] for r in report["pipeline"]["runs"]} == {"carpool", "celery"}
    assert all(r["extra"]["model"] == "null" for r in report["pipeline"]["runs"])
    names = {t["name"] for t in report["targets"]}
    assert {"burst_vs_offline", "burst_vs_plain_celery", "null_pipeline_vs_plain_celery"} <= names
    assert all(t["met"] is None or isinstance(t["met"], bool) for t in report["targets"])
    assert {
        "throughput_vs_load.png",
        "latency_vs_load.png",
        "padding_ratio.png",
        "batch_sizes.png",
        "pipeline_null_model.png",
    } <= set(report["plots"])
    _check_pngs(out, report["plots"])
    assert "targets:" in proc.stdout


def test_quick_bench_with_celery_batches_and_asyncio(tmp_path: Path) -> None:
    from carpool.tools.bench.report import validate_report

    out = tmp_path / "bench"
    proc = _run_bench(
        out,
        "--systems",
        "celery-batches,asyncio",
        "--requests",
        "40",
        "--light",
        "0",
        "--pipeline",
        "0",
        "--rates",
        "200,400",
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert validate_report(report) == [] and report["errors"] == []
    assert report["pipeline"] is None
    by_system: dict[str, list[dict[str, Any]]] = {}
    for run in report["runs"]:
        by_system.setdefault(run["system"], []).append(run)
    assert set(by_system) == {"celery-batches", "asyncio"}
    for name, runs in by_system.items():
        burst = next(r for r in runs if r["mode"] == "burst")
        assert burst["completed"] == 40, name
        # Both buffer requests: a burst of 40 with max batch 32 never runs one at a time.
        assert burst["batches"]["count"] < 40 and burst["padding_ratio"] >= 1.0, name
        assert sorted(r["offered_rps"] for r in runs if r["mode"] == "rate" and not r["half_saturation"]) == [
            200.0,
            400.0,
        ]
    _check_pngs(out, report["plots"])


def test_sweep_mode(tmp_path: Path) -> None:
    from carpool.tools.bench.report import validate_report

    out = tmp_path / "sweep"
    proc = _run_bench(out, "--sweep", "--requests", "16", "--sweep-batches", "4,16", "--sweep-waits", "0.01")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert validate_report(report) == [] and report["errors"] == []
    points = report["sweep"]["points"]
    assert [(p["max_batch"], p["max_wait_s"]) for p in points] == [(4, 0.01), (16, 0.01)]
    for p in points:
        assert sorted(r["mode"] for r in p["runs"]) == ["burst", "rate"]
    # A max batch of 4 cannot make batches larger than 4.
    small = next(r for r in points[0]["runs"] if r["mode"] == "burst")
    assert max(int(k) for k in small["batches"]["sizes"]) <= 4
    assert "sweep_throughput_latency.png" in report["plots"]
    _check_pngs(out, report["plots"])


def test_rate_specs_and_arrivals() -> None:
    from carpool.tools.arrivals import poisson_times
    from carpool.tools.bench.measure import parse_rates
    from carpool.tools.stats import percentile

    assert parse_rates("0.5x, 1x,250") == [(0.5, True), (1.0, True), (250.0, False)]
    with pytest.raises(ValueError):
        parse_rates("0")
    arrivals = poisson_times(2000, 100.0, seed=3, first_at_zero=False)
    assert arrivals == sorted(arrivals) and arrivals == poisson_times(
        2000, 100.0, seed=3, first_at_zero=False
    )
    assert 17 < arrivals[-1] < 23  # about 2000 / 100 s
    assert percentile([3, 1, 2], 50) == 2


def test_accelerator_mode_reports_ratios_cpu_and_the_device_busy_fraction(tmp_path: Path) -> None:
    from carpool.tools.bench.accelerator_report import COMPONENTS, SCHEMA, validate_report

    out = tmp_path / "accel"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARPOOL_")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "carpool.tools.bench",
            "--accelerator",
            "h100",
            "--requests",
            "96",
            "--pipeline",
            "60",
            "--light",
            "3",
            "--coordinators",
            "2",
            "--as-array",
            "--out",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert validate_report(report) == [] and report["errors"] == []
    assert report["schema"] == SCHEMA and report["model"] == "sim-h100"
    # Two coordinators shared the request queue; each request was answered once, through one of them.
    assert report["config"]["coordinators"] == 2
    assert len(list((out / "logs").glob("carpool-coordinator*.log"))) == 2
    assert report["capacity"]["texts_per_s"] > 0
    carpool = report["carpool"]
    assert carpool["requests"] == 96 and carpool["throughput_rps"] > 0 and carpool["ratio_to_capacity"] > 0
    assert {k for k, _ in COMPONENTS} <= set(carpool["cpu_us_per_request"])
    assert report["config"]["as_array"] is True  # the burst gathered as one array: the same figures
    busy = report["device_busy"]
    assert busy["forwards"] >= 1 and busy["devices"] == 1
    assert 0.0 < busy["overall"] <= 1.0
    assert all(0.0 <= v <= 1.0 for v in busy["buckets"])
    # Cores per component over the burst, on the device's buckets; over the whole burst they add up
    # to what the per-request figures say (coordinators and workers summed, the producer's two parts).
    over = report["cpu_over_run"]
    assert set(over["components"]) == {"coordinator", "worker", "redis", "producer"}
    assert len(over["total"]) == len(busy["buckets"]) and over["machine_cores"] == os.cpu_count()
    cpu = carpool["cpu_us_per_request"]
    by_request = {
        "coordinator": cpu["coordinator"],
        "worker": cpu["worker"],
        "producer": cpu["producer_submit"] + cpu["producer_gather"],
    }
    for role, us in by_request.items():
        cores = us * carpool["requests"] / 1e6 / carpool["wall_s"]
        # /proc counts in 10 ms ticks, and the sampler's first and last readings bracket the burst
        assert over["whole_run"]["cores"][role] == pytest.approx(cores, abs=0.02 / carpool["wall_s"] + 0.1)
    pipeline = report["pipeline"]
    assert pipeline["carpool"]["requests"] == 60 and pipeline["celery_noop"]["tasks"] == 60
    assert pipeline["ratio"] > 0
    assert report["light"]["requests"] == 3 and report["light"]["latency_ms"]["p99"] > 0
    assert {"throughput_vs_device_capacity", "null_pipeline_vs_plain_celery"} <= {
        t["name"] for t in report["targets"]
    }
    assert {"device_busy.png", "cpu_per_request.png"} <= set(report["plots"])
    _check_pngs(out, report["plots"])
    assert "Targets" in proc.stdout

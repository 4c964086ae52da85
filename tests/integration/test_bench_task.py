"""``carpool bench --task``: a reranker through carpool, celery-batches and plain Celery in one run, on a
tiny cross-encoder built here. Every item answered in every system, the same scores everywhere, and a
well-formed report; no timing assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.tolerances import VECTOR_ATOL
from tests.unit.test_adapters import PAIRS, save_classifier

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _run_bench(out: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CARPOOL_")}
    return subprocess.run(
        [sys.executable, "-m", "carpool.tools.bench", "--out", str(out), "--max-wait", "0.02", *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=280,
    )


def _by_system(report: dict[str, Any], mode: str) -> dict[str, dict[str, Any]]:
    return {r["system"]: r for r in report["runs"] if r["mode"] == mode}


def test_builtin_reranker_in_every_system(tmp_path: Path) -> None:
    from carpool.adapters import reranker
    from carpool.tools.bench.task_report import SCHEMA, validate_report
    from carpool.tools.workload import rerank_pairs

    model_dir = save_classifier(tmp_path / "reranker", num_labels=1)
    out = tmp_path / "bench"
    n = 24
    proc = _run_bench(
        out, "--task", "reranker", "--model-dir", str(model_dir), "--requests", str(n), "--rates", "30"
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert validate_report(report) == [] and report["errors"] == []
    assert report["schema"] == SCHEMA
    assert report["task"]["name"] == "carpool.bench.rerank" and report["task"]["max_batch"] == 32
    assert report["workload"]["requests"] == n and report["workload"]["lengths"]["max"] <= 64

    bursts = _by_system(report, "burst")
    assert set(bursts) == {"carpool", "celery-batches", "celery"}
    for run in report["runs"]:
        assert run["requests"] == n and run["completed"] == n and run["failed"] == 0, run
    assert sorted(r["offered_rps"] for r in report["runs"] if r["mode"] == "rate") == [30.0] * 3
    # Batches and padding come from the task's own length, in each system.
    assert bursts["carpool"]["batches"]["count"] >= 1 and bursts["carpool"]["padding_ratio"] >= 1.0
    sizes = bursts["celery-batches"]["batches"]["sizes"]
    assert sum(int(size) * count for size, count in sizes.items()) == n
    assert bursts["celery-batches"]["padding_ratio"] >= 1.0
    assert bursts["celery"]["batches"]["sizes"] == {"1": n}

    comparison = report["comparison"]
    assert comparison["carpool_vs_celery_batches"] > 0 and comparison["carpool_vs_celery"] > 0
    assert comparison["outputs_agree"] == {"celery-batches": True, "celery": True}
    # The same scores everywhere, and the scores the reranker gives in this process.
    samples = report["samples"]
    assert samples["items"] == rerank_pairs(n, 0)[: len(samples["items"])]
    expected = reranker(model_dir)(samples["items"])
    for system in ("carpool", "celery-batches", "celery"):
        assert samples["outputs"][system] == pytest.approx(expected, abs=VECTOR_ATOL), system
    assert "carpool / celery-batches" in proc.stdout and "celery-batches agrees" in proc.stdout


def test_a_user_task_on_items_from_a_file(tmp_path: Path) -> None:
    from carpool.tools.bench.task_report import validate_report

    models = tmp_path / "models"
    save_classifier(models / "reranker", num_labels=1)
    items = tmp_path / "pairs.jsonl"
    items.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    out = tmp_path / "bench"
    proc = _run_bench(
        out,
        "--task",
        "tests.integration.rerank_tasks:rerank",
        "--items",
        str(items),
        "--requests",
        "10",
        "--systems",
        "carpool,celery-batches",
        CARPOOL_TEST_MODELS_DIR=str(models),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert validate_report(report) == [] and report["errors"] == []
    assert report["task"]["name"] == "tests.rerank" and report["task"]["max_batch"] == 16  # the task's own
    bursts = _by_system(report, "burst")
    assert set(bursts) == {"carpool", "celery-batches"}
    assert all(r["completed"] == 10 and r["failed"] == 0 for r in bursts.values())
    samples = report["samples"]
    assert samples["items"] == (PAIRS * 3)[:8]  # the file's items, repeated up to --requests
    assert report["comparison"]["outputs_agree"] == {"celery-batches": True}
    assert report["comparison"]["carpool_vs_celery"] is None

"""Whole processes, started as users start them: what they import, and how a bad setting stops them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import Processes


@pytest.mark.parametrize(
    "statement",
    [
        "import carpool.tasks",
        "from carpool import batched, submit_many, gather",
        # a producer importing a task module that builds adapters over model directories
        "import carpool.adapters; carpool.adapters.reranker('/models/x'); carpool.adapters.embedding('/m')",
    ],
)
def test_the_producer_side_does_not_import_torch(statement: str) -> None:
    code = (
        f"import sys; {statement}; "
        "heavy = [m for m in ('torch', 'numpy', 'transformers', 'tokenizers') if m in sys.modules]; "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_process_with_a_bad_setting_stops_at_start_with_the_message() -> None:
    env = {"CARPOOL_MAX_WAIT_S": "-1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "carpool", "coordinator"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "CARPOOL_MAX_WAIT_S" in proc.stderr
    assert "greater than or equal to 0" in proc.stderr


def test_a_coordinator_whose_model_cannot_be_imported_stops_at_start_saying_so() -> None:
    env = {"CARPOOL_MODEL": "nosuch.mod:Cls", "CARPOOL_METRICS_PORT": "0", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "carpool", "coordinator"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert "model 'nosuch.mod:Cls' cannot be imported" in proc.stderr and "CARPOOL_MODEL" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        ("app.conf.result_extended = True", "result_extended=True"),
        ("app.conf.task_track_started = True", "track_started"),
        # Celery's worker would space the tasks out; annotations reach the tasks as they bind.
        ("app.conf.task_annotations = {'carpool.infer': {'rate_limit': '10/m'}}", "rate_limit='10/m'"),
        ("app.conf.task_annotations = {'carpool.infer': {'time_limit': 2}}", "time_limit=2"),
        ("app.conf.task_soft_time_limit = 1", "soft_time_limit=1"),
    ],
)
def test_celery_settings_carpool_cannot_honour_stop_the_coordinator_at_start(
    tmp_path: Path, setting: str, needle: str
) -> None:
    """Celery reads them where results are stored: carpool's coordinators and workers refuse them
    instead of storing results without what they promise."""
    (tmp_path / "conf_tasks.py").write_text(f"from carpool.celery_app import app\n{setting}\n")
    env = {
        "CARPOOL_IMPORTS": "conf_tasks",
        "CARPOOL_METRICS_PORT": "0",
        "PYTHONPATH": f"{tmp_path}:{Path.cwd()}",
        "PATH": "/usr/bin:/bin",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "carpool", "coordinator"], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and "is not supported by carpool" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_worker_whose_model_fails_to_load_stops_instead_of_staying_up_serving_nothing(
    processes: Processes,
) -> None:
    """Celery only logs a worker_ready handler's exception: the worker must stop on its own."""
    from tests.integration.models import BROKEN_LOAD

    proc = processes.start("worker0", "worker", CARPOOL_MODEL=BROKEN_LOAD, CARPOOL_MODELS=BROKEN_LOAD)
    assert proc.wait(timeout=60) == 1, "a failed start, seen by the worker's supervisor"
    log = (processes.log_dir / "worker0.log").read_text(errors="replace")
    assert "could not start serving" in log and "weights file missing" in log, log
    assert " ready." not in log.split("could not start serving", 1)[1], "a stopping worker is not ready"


def test_a_worker_refuses_a_celery_setting_carpool_cannot_honour(processes: Processes) -> None:
    proc = processes.start("worker0", "worker", CARPOOL_IMPORTS="tests.integration.extended_conf_tasks")
    assert proc.wait(timeout=60) == 2, "a configuration error, seen by the worker's supervisor"
    log = (processes.log_dir / "worker0.log").read_text(errors="replace")
    assert "result_extended=True is not supported by carpool" in log, log
    assert " ready." not in log, log

"""The pure parts of ``carpool bench --task``: the built-in pairs, items files, resolving a task, lengths,
padding from logged batches, the comparison of outputs, the report's schema and table, CLI refusals."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from carpool.tools.bench.measure import padding_of_batches
from carpool.tools.bench.task_mode import MODEL_DIR_ENV, load_items, repeat_to, resolve_task, task_lengths
from carpool.tools.bench.task_report import SCHEMA, compare, outputs_agree, print_report, validate_report
from carpool.tools.workload import WORDS, rerank_pairs

BATCHED_TASKS = "tests.integration.batched_tasks"


def test_rerank_pairs_are_seeded_short_queries_with_passages_of_mixed_lengths() -> None:
    pairs = rerank_pairs(300, seed=4)
    assert pairs == rerank_pairs(300, seed=4) and pairs != rerank_pairs(300, seed=5)
    assert all(isinstance(p, list) and len(p) == 2 for p in pairs)
    query_words = [len(q.split()) for q, _ in pairs]
    assert min(query_words) >= 2 and max(query_words) <= 8
    assert all(q.endswith("?") and q.split()[0].lower() in WORDS for q, _ in pairs)
    passage_words = [len(p.split()) for _, p in pairs]
    assert min(passage_words) <= 20 and max(passage_words) > 80


def test_load_items_reads_one_json_value_per_line(tmp_path: Path) -> None:
    path = tmp_path / "items.jsonl"
    path.write_text('["q", "p"]\n\n{"a": [1, 2.5]}\n"text"\n7\n')
    assert load_items(path) == [["q", "p"], {"a": [1, 2.5]}, "text", 7]
    path.write_text('"ok"\nnot json\n')
    with pytest.raises(ValueError, match=r"items\.jsonl:2: not a JSON value"):
        load_items(path)
    path.write_text("\n  \n")
    with pytest.raises(ValueError, match="holds no items"):
        load_items(path)


def test_repeat_to_cuts_or_cycles() -> None:
    assert repeat_to([1, 2, 3], 2) == [1, 2]
    assert repeat_to([1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]


def test_resolve_task_imports_the_module_and_takes_the_tasks_own_max_batch() -> None:
    shout = resolve_task(f"{BATCHED_TASKS}:shout", 32)
    assert shout.name == f"{BATCHED_TASKS}.shout" and shout.module == BATCHED_TASKS
    assert shout.max_batch == 8  # @batched(max_batch=8) wins over the bench's
    pairs = resolve_task(f"{BATCHED_TASKS}:pair_sum", 32)
    assert pairs.name == "tests.pairs" and pairs.max_batch == 32
    env = pairs.child_env()
    assert env["CARPOOL_IMPORTS"] == BATCHED_TASKS and env["CARPOOL_BENCH_TASK"] == "tests.pairs"


def test_resolve_task_refuses_what_is_not_a_batched_task(monkeypatch: pytest.MonkeyPatch) -> None:
    from carpool.errors import ConfigError

    with pytest.raises(ValueError, match=r"package\.module:attribute"):
        resolve_task(BATCHED_TASKS, 32)
    with pytest.raises(ValueError, match="not a @batched task"):
        resolve_task(f"{BATCHED_TASKS}:os", 32)
    with pytest.raises(ConfigError, match="cannot be imported"):
        resolve_task("no_such_package.tasks:f", 32)
    monkeypatch.delenv(MODEL_DIR_ENV, raising=False)
    with pytest.raises(ValueError, match="needs --model-dir"):
        resolve_task("reranker", 32)
    with pytest.raises(ValueError, match="not a directory"):
        resolve_task("reranker", 32, model_dir="/nonexistent/model")


def test_the_builtin_reranker_reads_its_directory_and_counts_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.unit.test_adapters import WINDOW, save_classifier

    model_dir = save_classifier(tmp_path / "reranker", num_labels=1)
    monkeypatch.delenv(MODEL_DIR_ENV, raising=False)
    task = resolve_task("reranker", 32, model_dir=str(model_dir))
    assert task.name == "carpool.bench.rerank" and task.module == "carpool.tools.bench.rerank_task"
    assert task.extra_env == {MODEL_DIR_ENV: str(model_dir.resolve())}
    assert task.child_env()[MODEL_DIR_ENV] == str(model_dir.resolve())
    lengths = task_lengths(task.name, rerank_pairs(50, seed=1))
    assert all(isinstance(n, int) and 3 <= n <= WINDOW for n in lengths)
    assert len(set(lengths)) > 5  # mixed lengths, not one bin


def test_task_lengths_names_the_failure() -> None:
    resolve_task(f"{BATCHED_TASKS}:pair_sum", 32)
    assert task_lengths("tests.pairs", [{"a": [1], "b": [2, 3]}]) == [3]
    with pytest.raises(ValueError, match=r"tests\.pairs: length fails on the workload.s items: TypeError"):
        task_lengths("tests.pairs", ["not a dict"])


def test_padding_of_logged_batches() -> None:
    length_of = {"a": 3, "b": 9, "c": 17, "d": 1}
    sizes, padded, real = padding_of_batches([["a", "b"], ["c"], ["d", "unknown"], ["gone"]], length_of)
    assert sizes == Counter({1: 2, 2: 1})  # the batch of unknown ids alone is left out
    assert padded == 2 * 16 + 24 + 8 and real == 3 + 9 + 17 + 1


def test_outputs_agree_within_tolerance_recursively() -> None:
    assert outputs_agree(
        [0.5, {"label": "x", "scores": [1.0, 2.0]}], [0.5000001, {"label": "x", "scores": [1, 2]}]
    )
    assert not outputs_agree([0.5], [0.51])
    assert not outputs_agree({"label": "x"}, {"label": "y"})
    assert not outputs_agree({"a": 1}, {"a": 1, "b": 2})
    assert not outputs_agree([1, 2], [1, 2, 3])
    assert not outputs_agree(True, 1) and outputs_agree(False, False)
    assert not outputs_agree({"error": "ModelError: x"}, 0.5)


def _run(system: str, rps: float, mode: str = "burst", failed: int = 0) -> dict[str, Any]:
    return {
        "system": system,
        "mode": mode,
        "requests": 10,
        "completed": 10 - failed,
        "failed": failed,
        "throughput_rps": rps,
        "offered_rps": None if mode == "burst" else 5.0,
        "latency_ms": {"p50": 10.0, "p90": 20.0, "p99": 30.0, "mean": 12.0, "max": 31.0},
        "batches": {"count": 2, "mean_size": 5.0, "sizes": {"5": 2}},
        "padding_ratio": 1.25,
        "extra": {},
    }


def test_compare_gives_carpools_ratios_and_agreement_with_carpool() -> None:
    runs = [
        _run("carpool", 300.0),
        _run("carpool", 5.0, "rate"),
        _run("celery-batches", 100.0),
        _run("celery", 30.0),
    ]
    outputs = {"carpool": [0.5, 0.25], "celery-batches": [0.5, 0.25], "celery": [0.5, 0.75]}
    result = compare(runs, outputs)
    assert result["burst_rps"] == {"carpool": 300.0, "celery-batches": 100.0, "celery": 30.0}
    assert result["carpool_vs_celery_batches"] == pytest.approx(3.0)
    assert result["carpool_vs_celery"] == pytest.approx(10.0)
    assert result["reference"] == "carpool"
    assert result["outputs_agree"] == {"celery-batches": True, "celery": False}
    alone = compare([_run("celery", 30.0)], {"celery": [1.0], "celery-batches": [1.0]})
    assert alone["carpool_vs_celery"] is None and alone["reference"] == "celery"
    assert alone["outputs_agree"] == {"celery-batches": True}


def _report() -> dict[str, Any]:
    runs = [_run("carpool", 300.0), _run("celery-batches", 100.0, failed=2)]
    outputs = {"carpool": [0.5], "celery-batches": [0.5]}
    return {
        "schema": SCHEMA,
        "created_at": "2026-01-01T00:00:00+00:00",
        "command": "carpool bench --task reranker",
        "machine": {"cpus": 2},
        "task": {"given": "reranker", "name": "carpool.bench.rerank", "module": "m", "max_batch": 32},
        "config": {"max_wait_s": 0.05},
        "workload": {
            "source": "built-in [query, passage] pairs",
            "requests": 10,
            "lengths": {"p50": 9.0, "max": 64.0},
        },
        "runs": runs,
        "comparison": compare(runs, outputs),
        "samples": {"items": [["q", "p"]], "outputs": outputs, "tolerance": {"rel": 1e-4, "abs": 1e-5}},
        "errors": [{"system": "celery", "phase": "start", "error": "ProcessExited('[boom]')"}],
    }


def test_validate_report_accepts_a_well_formed_report_and_names_problems() -> None:
    report = _report()
    assert validate_report(json.loads(json.dumps(report))) == []
    assert validate_report([]) == ["report is not an object"]
    broken = dict(report, schema="other", runs=[{"system": "carpool"}], comparison={})
    problems = validate_report(broken)
    assert any("schema" in p for p in problems)
    assert any(p.startswith("run 0:") for p in problems)
    assert "comparison.burst_rps missing" in problems


def test_print_report_shows_each_system_the_ratios_and_the_agreement() -> None:
    from rich.console import Console

    console = Console(record=True, width=100)
    print_report(_report(), console)
    text = console.export_text()
    assert "[query, passage]" in text  # the source is printed, not read as markup
    assert "carpool" in text and "celery-batches" in text and "2 x 5.0" in text
    assert "carpool / celery-batches: 3.00" in text
    assert "celery-batches agrees" in text
    assert "ProcessExited('[boom]')" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--items", "x.jsonl"], "--items and --model-dir go with --task"),
        (["--task", "no_such_package.tasks:f"], "cannot be imported"),
        (["--task", f"{BATCHED_TASKS}:shout", "--sweep"], "no sweep"),
        (["--task", f"{BATCHED_TASKS}:shout", "--systems", "carpool,asyncio"], "not asyncio"),
        (["--task", f"{BATCHED_TASKS}:shout", "--rates", "0.5x"], "requests/s"),
        (["--task", f"{BATCHED_TASKS}:shout", "--accelerator", "h100"], "separate modes"),
    ],
)
def test_cli_refuses_bad_task_options_before_starting_anything(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from carpool.tools.bench.cli import main

    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()

"""What operators see: Flower lists every request and batch, Prometheus counts add up, `carpool status`.

Real processes against the session's redis-server: a Flower process (started before anything is
sent, so it hears every event), a coordinator and a GPU worker serving the toy model.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from carpool.tools.embedded import EmbeddedRedis, free_port
from carpool.tools.workload import mixed_texts
from tests.integration.conftest import Processes, as_bytes, server_of, start_stack, wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TOY = {"CARPOOL_MODEL": "toy", "CARPOOL_MODELS": "toy"}
FLOWER_USER, FLOWER_PASSWORD = "user", "pass"
TASKS_COLUMNS = "name,uuid,state,args,received,runtime,worker"
BATCH_ARGS = re.compile(
    r"size=(?P<size>\d+) bin=(?P<bin>\S+) width=(?P<width>\d+) padding=(?P<padding>[\d.]+) "
    r"flush=(?P<flush>\S+) model=(?P<model>\S+)"
)


def http_get(url: str, auth: tuple[str, str] | None = None, timeout_s: float = 10) -> bytes:
    headers = {}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as resp:
        return bytes(resp.read())


def stats_hash(processes: Processes) -> dict[str, float]:
    import redis

    raw = redis.Redis(port=server_of(processes).port).hgetall("carpool:carpool.requests:stats")
    return {as_bytes(k).decode(): float(v) for k, v in raw.items()}


def send_and_get(texts: list[str], timeout_s: float = 120) -> list[str]:
    from carpool.tasks import infer

    results = [infer.delay(t, model="toy") for t in texts]
    for r in results:
        r.get(timeout=timeout_s)
    return [r.id for r in results]


def send_bad_request() -> str:
    """A request that passed no producer validation (send_task skips it): the coordinator fails it."""
    from carpool.celery_edge.app import app
    from carpool.errors import InvalidInput

    bad = app.send_task("carpool.infer", args=[123])
    with pytest.raises(InvalidInput):
        bad.get(timeout=60)
    return str(bad.id)


# --- Flower ------------------------------------------------------------------------------------------
@dataclass
class Flower:
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str, auth: bool = True) -> bytes:
        return http_get(self.base + path, (FLOWER_USER, FLOWER_PASSWORD) if auth else None)

    def tasks(self, taskname: str | None = None) -> dict[str, dict[str, Any]]:
        query = f"?taskname={taskname}" if taskname else ""
        return dict(json.loads(self.get(f"/api/tasks{query}")))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""


@pytest.fixture()
def flower(processes: Processes, tmp_path: Path) -> Iterator[Flower]:
    """A real Flower process with basic auth, up and answering before the test sends anything."""
    port = free_port()
    log_path = tmp_path / "flower.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "carpool.celery_app",
                "flower",
                f"--port={port}",
                "--address=127.0.0.1",
                f"--basic-auth={FLOWER_USER}:{FLOWER_PASSWORD}",
                # The args column shows each request's text and each batch's size/bin/padding summary.
                f"--tasks_columns={TASKS_COLUMNS}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=processes.env(**TOY),
            cwd=REPO,
        )
    fl = Flower(port, proc, log_path)
    try:

        def answering() -> bool:
            if proc.poll() is not None:
                pytest.fail(f"flower exited with {proc.returncode}:\n{fl.log()}")
            fl.get("/api/tasks?limit=1")
            return True

        wait_for("flower answering on /api/tasks", answering, timeout_s=60)
        yield fl
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_flower_listening(flower: Flower, attempts: int = 10) -> list[str]:
    """Flower answers HTTP before its event receiver is subscribed, and the coordinator and worker
    build events once their probe has found it (``CARPOOL_EVENTS=auto``): send probes until one
    shows with the events of both."""
    probes = []
    for n in range(attempts):
        probes += send_and_get([f"probe number {n} for flower"], timeout_s=60)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            task = flower.tasks("carpool.infer").get(probes[-1])
            if task and task.get("state") == "SUCCESS" and task.get("received") is not None:
                return probes
            time.sleep(0.2)
    pytest.fail(f"flower never listed a probe request:\n{flower.log()}")


def test_flower_lists_every_request_and_every_batch(processes: Processes, flower: Flower) -> None:
    # Basic auth is on for the API and the pages alike.
    for path in ("/api/tasks", "/tasks"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            flower.get(path, auth=False)
        assert refused.value.code == 401, path
    with pytest.raises(urllib.error.HTTPError) as wrong:
        http_get(flower.base + "/api/tasks", ("user", "wrong"))
    assert wrong.value.code == 401

    start_stack(processes, **TOY)
    probes = wait_flower_listening(flower)
    texts = mixed_texts(300, seed=11)
    ids = send_and_get(texts)
    bad_id = send_bad_request()

    def all_listed() -> dict[str, dict[str, Any]]:
        tasks = flower.tasks("carpool.infer")
        missing = [i for i in ids if tasks.get(i, {}).get("state") != "SUCCESS"]
        assert not missing, f"{len(missing)} of {len(ids)} not SUCCESS yet, e.g. {tasks.get(missing[0])}"
        assert tasks.get(bad_id, {}).get("state") == "FAILURE", tasks.get(bad_id)
        return tasks

    tasks = wait_for("every request as SUCCESS in flower", all_listed, timeout_s=60, every_s=0.5)
    for task_id, text in zip(ids, texts, strict=True):
        t = tasks[task_id]
        assert t["name"] == "carpool.infer"
        assert t["runtime"] is not None and t["runtime"] > 0, t
        assert t["received"] is not None and t["started"] is not None and t["succeeded"] is not None, t
        assert t["received"] <= t["started"] <= t["succeeded"], t
        assert str(t["worker"]).startswith("carpool-gpu-"), t
        assert text[:40] in t["args"], (t["args"], text)  # the text itself, as the producer's argsrepr
        assert "'model': 'toy'" in t["kwargs"]
        assert t["result"].startswith("["), t["result"]  # the embedding, shortened

    bad = tasks[bad_id]
    assert bad["name"] == "carpool.infer" and bad["args"] == "[123]"
    # Refused at intake, it still shows as received (by the coordinator) before it failed.
    assert bad["received"] is not None and bad["received"] <= bad["failed"], bad
    assert "InvalidInput" in bad["exception"] and "must be a str" in bad["exception"], bad

    batches = flower.tasks("carpool.run_batch")
    assert batches, "no carpool.run_batch task in flower"
    sizes = 0
    bins: set[str] = set()
    for task_id, b in batches.items():
        m = BATCH_ARGS.fullmatch(b["args"])
        assert m, f"batch {task_id} args {b['args']!r} are not the size/bin/width/padding summary"
        assert m["model"] == "toy" and int(m["width"]) % 8 == 0 and float(m["padding"]) >= 1.0
        assert b["state"] == "SUCCESS" and b["runtime"] is not None, b
        assert f"'size': {m['size']}" in b["result"], b["result"]  # the worker's report
        sizes += int(m["size"])
        bins.add(m["bin"])
    # Every request rode in exactly one batch: the batch sizes add up to the requests served.
    assert len(ids) <= sizes <= len(ids) + len(probes), (sizes, len(ids), len(probes))
    assert len(bins) > 1, "one bin only?"


# --- Prometheus ---------------------------------------------------------------------------------------
def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """``/metrics`` parsed: sample name -> [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    text = http_get(f"http://127.0.0.1:{port}/metrics").decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def total(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == w for k, w in labels.items()))


def test_prometheus_metrics_add_up(processes: Processes) -> None:
    from carpool.tasks import infer

    port = free_port()
    start_stack(processes, CARPOOL_METRICS_PORT=str(port), **TOY)
    wait_for("metrics endpoint", lambda: scrape(port), timeout_s=30)
    texts = mixed_texts(300, seed=5)
    # The worker paused, the requests wait in their bins for a stats write to see: a burst served
    # between two writes (every 0.25 s) left the depth gauges without a label.
    worker = processes.procs["worker0"]
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        sent = [infer.delay(t, model="toy") for t in texts]
        wait_for("requests waiting in their bins", lambda: total(scrape(port), "carpool_queue_depth") > 0)
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    for result in sent:
        result.get(timeout=120)
    send_bad_request()

    def settled() -> dict[str, list[tuple[dict[str, str], float]]]:
        m = scrape(port)
        batches = total(m, "carpool_batch_size_count")
        # Run times arrive with the workers' batch reports, a moment after the results.
        assert batches > 0 and total(m, "carpool_batch_run_seconds_count") == batches, "reports pending"
        assert total(m, "carpool_queue_depth") == 0
        # The refused request's failure is counted after its result is stored and acknowledged.
        assert total(m, "carpool_failures_total", reason="invalid") == 1, "failure pending"
        return m

    m = wait_for("every batch report in the metrics", settled, timeout_s=30)
    stats = wait_for(
        "stats hash caught up",
        lambda: (s := stats_hash(processes)).get("batches") == total(m, "carpool_batch_size_count") and s,
        timeout_s=10,
    )
    batches = total(m, "carpool_batch_size_count")
    n = len(texts)
    assert batches == stats["batches"]
    assert 1 < batches < n, "requests should have been batched"
    assert total(m, "carpool_batch_size_sum") == n == stats["dispatched"]
    assert total(m, "carpool_batch_size_bucket", le="+Inf") == batches
    assert len({lab["bin"] for lab, _ in m["carpool_batch_size_count"]}) > 1, "mixed lengths, one bin?"
    assert all(lab["model"] == "toy" for lab, _ in m["carpool_batch_size_count"])
    assert all(lab["task"] == "carpool.infer" for lab, _ in m["carpool_batch_size_count"])

    padded, real = total(m, "carpool_padded_tokens_total"), total(m, "carpool_real_tokens_total")
    assert padded >= real > 0
    assert (padded, real) == (stats["padded_tokens"], stats["real_tokens"])

    assert total(m, "carpool_requests_total") == n + 1  # and the bad one
    assert total(m, "carpool_wait_seconds_count") == n
    assert total(m, "carpool_wait_seconds_sum") > 0
    assert total(m, "carpool_batch_run_seconds_count", model="toy", device="cpu") == batches
    assert total(m, "carpool_batch_run_seconds_sum") > 0
    flushes = {lab["reason"]: v for lab, v in m["carpool_flushes_total"]}
    assert sum(flushes.values()) == batches, flushes
    assert flushes == {k.split(":", 1)[1]: v for k, v in stats.items() if k.startswith("flush:")}
    assert total(m, "carpool_failures_total", reason="invalid") == 1
    assert total(m, "carpool_failures_total") == 1
    assert total(m, "carpool_workers") == 1
    depth_labels = {(lab["model"], lab["bin"]) for lab, _ in m.get("carpool_queue_depth", [])}
    assert depth_labels and all(model == "toy" for model, _ in depth_labels)


# --- carpool status ---------------------------------------------------------------------------------
def status_command() -> list[str]:
    """``carpool status`` once the CLI has it; ``python -m carpool.tools.status`` (same code) until then."""
    from carpool.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    if "status" in (sub.choices or {}):
        return [sys.executable, "-m", "carpool", "status"]
    return [sys.executable, "-m", "carpool.tools.status"]


def run_status(processes: Processes, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*status_command(), *args],
        env=processes.env(**env),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def test_status_once_shows_workers_depth_and_counters(processes: Processes) -> None:
    import redis

    from carpool.redis_edge.keys import Keys
    from carpool.tools.status import collect, rates

    # A coordinator with no worker yet holds what it takes: depth per bin, in flight, nothing queued.
    processes.start("coordinator", "coordinator", **TOY)
    from carpool.tasks import infer

    client = redis.Redis(port=server_of(processes).port)
    keys = Keys("carpool.requests")
    texts = mixed_texts(60, seed=2)
    held = [infer.delay(t, model="toy") for t in texts]
    # Pending counts what the intake stage still prepares too; the bins' depths only what it admitted.
    wait_for(
        "coordinator holding every request in its bins",
        lambda: (
            (s := collect(client, keys)).pending == len(texts) and sum(s.depth_by_bin.values()) == len(texts)
        ),
    )
    proc = run_status(processes, "--json", "--interval", "0")
    assert proc.returncode == 0, proc.stderr
    snap = json.loads(proc.stdout)
    assert snap["workers_online"] == 0 and snap["queued"] == 0
    assert snap["pending"] == snap["in_flight"] == len(texts)
    assert sum(snap["depth_by_bin"].values()) == len(texts), snap["depth_by_bin"]
    assert all(k.startswith("toy:") for k in snap["depth_by_bin"])
    assert snap["task_of_model"] == {"toy": "carpool.infer"}
    assert len([v for v in snap["depth_by_bin"].values() if v]) > 1
    text_view = run_status(processes, "--once", "--interval", "0")
    assert text_view.returncode == 0, text_view.stderr
    assert "per length bin" in text_view.stdout and "carpool.infer" in text_view.stdout
    assert "model=toy" in text_view.stdout

    # A worker comes up: everything runs; rates over a window that saw a burst are real.
    before = collect(client, keys)
    processes.start("worker0", "worker", **TOY)
    processes.wait_workers(1)
    for r in held:
        r.get(timeout=120)
    more = mixed_texts(100, seed=4)
    send_and_get(more)
    client.lpush("carpool.requests", b"this is not a celery message")  # dead-lettered
    wait_for("dead letter", lambda: client.llen(keys.dead_letter) == 1)
    n = len(texts) + len(more)

    # The dead letter is pushed at once, its `taken` reaches the hash with the next counter write.
    def counters_written() -> bool:
        stats = stats_hash(processes)
        return stats.get("taken") == n + 1 and stats.get("dispatched") == n

    wait_for("counters written", counters_written)
    after = collect(client, keys)
    r = rates(before, after)
    # `before` came after the first 60 were taken, before any was dispatched.
    assert r.seconds > 0 and r.values["taken"] == pytest.approx((len(more) + 1) / r.seconds)
    assert r.values["dispatched"] == pytest.approx(n / r.seconds)
    assert r.padding_ratio is not None and r.padding_ratio >= 1.0

    proc = run_status(processes, "--json", "--interval", "0.3")
    assert proc.returncode == 0, proc.stderr
    snap = json.loads(proc.stdout)
    stats = stats_hash(processes)
    assert snap["workers_online"] == 1 and len(snap["workers"]) == 1
    assert snap["taken"] == n + 1 and snap["dispatched"] == n and snap["batches"] == stats["batches"] > 0
    assert snap["queued"] == snap["pending"] == snap["in_flight"] == 0
    assert snap["dead_letter"] == 1 and snap["failed"] == {"malformed": 1}
    assert snap["padding_ratio"] == pytest.approx(stats["padded_tokens"] / stats["real_tokens"])
    assert sum(snap["flush"].values()) == snap["batches"]
    assert sum(int(k) * v for k, v in snap["batch_sizes"].items()) == n
    assert snap["rates"]["seconds"] > 0 and snap["rates"]["taken"] == 0  # idle now
    assert sum(snap["depth_by_bin"].values()) == 0

    text_view = run_status(processes, "--once", "--interval", "0.3")
    assert text_view.returncode == 0, text_view.stderr
    out = text_view.stdout
    assert re.search(r"workers online\s+1\b", out), out
    assert snap["workers"][0] in out
    for label, value in (
        ("taken", n + 1),
        ("dispatched", n),
        ("batches", snap["batches"]),
        ("dead letter", 1),
    ):
        assert re.search(rf"{label}\s+{value:,}\b", out), (label, value, out)
    assert "malformed=1" in out and "req/s" in out and "padding ratio" in out


def test_status_lists_the_dead_letters_newest_first_each_bounded_in_size(processes: Processes) -> None:
    import redis

    from carpool.redis_edge.keys import Keys
    from carpool.redis_edge.store import DEAD_LETTER_BYTES

    keys = Keys("carpool.requests")
    client = redis.Redis(port=server_of(processes).port)
    processes.start("coordinator", "coordinator", **TOY)
    huge = b"\xff" + b"x" * (4 * 1024 * 1024)  # 4 MiB, and not UTF-8
    client.lpush("carpool.requests", b"first: not a celery message")
    wait_for("the first dead letter", lambda: client.llen(keys.dead_letter) == 1)
    client.lpush("carpool.requests", huge)
    wait_for("the second dead letter", lambda: client.llen(keys.dead_letter) == 2)
    # What Redis keeps of the 4 MiB message is its start, not the whole of it.
    used = client.memory_usage(keys.dead_letter)
    assert used is not None and used < 2 * DEAD_LETTER_BYTES + 4096

    proc = run_status(processes, "--dead-letters", "--json")
    assert proc.returncode == 0, proc.stderr
    newest, first = json.loads(proc.stdout)
    assert first["raw"] == "first: not a celery message" and first["truncated"] is False
    assert first["bytes"] == len("first: not a celery message") and "not JSON" in first["reason"]
    assert newest["bytes"] == len(huge) and newest["truncated"] is True
    assert newest["raw"].startswith("\ufffdxxx") and set(newest["raw"][1:]) == {"x"}
    assert DEAD_LETTER_BYTES - 500 < len(newest["raw"]) < DEAD_LETTER_BYTES
    assert "not UTF-8 (at byte 0" in newest["reason"]
    assert time.time() - 60 < first["at"] <= newest["at"] <= time.time()

    only_one = json.loads(run_status(processes, "--dead-letters", "1", "--json").stdout)
    assert [d["id"] for d in only_one] == [newest["id"]]

    table = run_status(processes, "--dead-letters")
    assert table.returncode == 0, table.stderr
    assert "first: not a celery message" in table.stdout and f"{len(huge):,} bytes" in table.stdout
    assert table.stdout.index(newest["id"][:20]) < table.stdout.index("first: not a celery")

    refused = run_status(processes, "--dead-letters", "0")
    assert refused.returncode == 2 and "must be >= 1" in refused.stderr


def test_status_sums_the_gauges_of_live_coordinators_only(
    clean_redis: EmbeddedRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    import redis

    from carpool.coordinator import stats as coordinator_stats
    from carpool.coordinator.stats import CoordinatorStats, StatsWriter
    from carpool.redis_edge.keys import Keys
    from carpool.tools.status import as_dict, collect

    monkeypatch.setattr(coordinator_stats, "GAUGES_TTL_S", 3)
    client = redis.Redis(port=clean_redis.port)
    keys = Keys("carpool.requests")
    one, two = (StatsWriter(client, keys, name, time.time) for name in ("c-one", "c-two"))
    one.write(CoordinatorStats(taken=5), {("toy", "1-16"): 3, ("toy", "17-32"): 1}, {"pending": 4})
    two.write(CoordinatorStats(taken=7), {("toy", "1-16"): 2}, {"pending": 2, "outstanding": 1})
    snap = as_dict(collect(client, keys), None, "carpool.requests")
    assert snap["coordinators"] == ["c-one", "c-two"]
    assert snap["pending"] == 6 and snap["outstanding_batches"] == 1
    assert snap["depth_by_bin"] == {"toy:1-16": 5, "toy:17-32": 1}
    assert snap["taken"] == 12

    # c-one stops writing (killed): its gauges expire and drop out; its counters stay counted.
    def one_left() -> bool:
        two.write(CoordinatorStats(taken=8), {("toy", "1-16"): 2}, {"pending": 2, "outstanding": 1})
        return collect(client, keys).coordinators == ["c-two"]

    wait_for("c-one's gauges expiring", one_left, timeout_s=10, every_s=0.2)
    snap = as_dict(collect(client, keys), None, "carpool.requests")
    assert snap["pending"] == 2 and snap["depth_by_bin"] == {"toy:1-16": 2}
    assert snap["taken"] == 13
    two.leave()  # a coordinator that stops cleanly withdraws its gauges at once
    snap = as_dict(collect(client, keys), None, "carpool.requests")
    assert snap["coordinators"] == [] and snap["pending"] == 0 and snap["depth_by_bin"] == {}


def test_coordinators_serving_otherwise_are_found_by_each_other_and_by_status(
    clean_redis: EmbeddedRedis,
) -> None:
    import redis

    from carpool.coordinator.stats import CoordinatorStats, StatsWriter, serving
    from carpool.redis_edge.keys import Keys
    from carpool.tools.status import as_dict, collect

    client = redis.Redis(port=clean_redis.port)
    keys = Keys("carpool.requests")
    toy = serving("toy", ["toy"], ["carpool.infer", "my.task"])
    writers = {
        name: StatsWriter(client, keys, name, time.time, serves)
        for name, serves in (
            ("c-one", toy),
            ("c-two", toy),
            ("c-three", serving("null", ["null"], ["carpool.infer"])),
        )
    }
    for writer in list(writers.values())[:2]:
        writer.write(CoordinatorStats(), {}, {"pending": 0})
    assert writers["c-one"].peers_serving_otherwise() == {}
    assert as_dict(collect(client, keys), None, "carpool.requests")["coordinators_disagree"] is False
    writers["c-three"].write(CoordinatorStats(), {}, {"pending": 0})
    assert writers["c-one"].peers_serving_otherwise() == {"c-three": writers["c-three"].serves}
    assert set(writers["c-three"].peers_serving_otherwise()) == {"c-one", "c-two"}
    snap = as_dict(collect(client, keys), None, "carpool.requests")
    assert snap["coordinators_disagree"] is True
    assert snap["coordinators_serve"]["c-three"] == "model=null models=null tasks=carpool.infer"
    assert snap["pending"] == 0  # the text field is no gauge to sum


def test_status_names_a_batch_queue_coordinators_send_to_and_no_live_worker_consumes(
    clean_redis: EmbeddedRedis,
) -> None:
    import redis

    from carpool.coordinator.stats import CoordinatorStats, StatsWriter
    from carpool.redis_edge.keys import Keys
    from carpool.redis_edge.store import RequestStore
    from carpool.tools.status import as_dict, collect

    client = redis.Redis(port=clean_redis.port)
    keys = Keys("carpool.requests")
    store = RequestStore(client, keys, 1)
    writers = [StatsWriter(client, keys, name, time.time) for name in ("c-one", "c-two")]
    store.heartbeat("w1", 30, ["carpool.batches"])
    # A queue no batch waits on is listed, not named: a deployment's default queue nobody uses.
    for writer in writers:
        writer.write(CoordinatorStats(), {}, {"outstanding:big": 0, "outstanding:carpool.batches": 1})
    snap = as_dict(collect(client, keys), None, "carpool.requests")
    assert snap["batch_queue_workers"] == {"big": 0, "carpool.batches": 1}
    assert snap["batch_queues_unserved"] == []
    writers[1].write(
        CoordinatorStats(), {}, {"outstanding:big": 2, "outstanding:carpool.batches": 0, "deferred": 3}
    )
    snap = as_dict(collect(client, keys), None, "carpool.requests")
    assert snap["batch_queues_unserved"] == ["big"]
    assert snap["held_for_eta"] == 3  # requests held for their countdown/eta, which max_pending counts
    store.heartbeat("w2", 30, ["big", "other"])  # a queue no coordinator of this deployment sends to
    snap = as_dict(collect(client, keys), None, "carpool.requests")
    assert snap["batch_queue_workers"] == {"big": 1, "carpool.batches": 1, "other": 1}
    assert snap["batch_queues_unserved"] == []
    store.leave("w2")
    assert as_dict(collect(client, keys), None, "carpool.requests")["batch_queues_unserved"] == ["big"]
    store.heartbeat("w3", 30)  # a worker of an earlier release, which does not say: nothing named
    snap = as_dict(collect(client, keys), None, "carpool.requests")
    assert snap["batch_queue_workers"]["big"] == 0 and snap["batch_queues_unserved"] == []
    assert snap["workers_not_saying_queues"] == ["w3"]


def test_two_coordinators_given_different_models_say_so(processes: Processes) -> None:
    """They answered the same text with different models, without a word (found by the review of
    deployments with several parts)."""
    processes.start("coordinator", "coordinator", **TOY)
    processes.start(
        "coordinator2", "coordinator", **{**TOY, "CARPOOL_MODEL": "null", "CARPOOL_MODELS": "null"}
    )
    wait_for(
        "a coordinator's error naming the other's model",
        lambda: any(
            "serves model=null" in processes.log(name) or "serves model=toy" in processes.log(name)
            for name in ("coordinator", "coordinator2")
        ),
        timeout_s=40,
    )
    logs = processes.log("coordinator") + processes.log("coordinator2")
    assert "give them all the same CARPOOL_MODEL, CARPOOL_MODELS and CARPOOL_IMPORTS" in logs, logs
    proc = run_status(processes, "--json", "--interval", "0")
    assert json.loads(proc.stdout)["coordinators_disagree"] is True, proc.stdout
    shown = run_status(processes, "--once", "--interval", "0").stdout
    assert "coordinators disagree" in shown and "model=null" in shown and "model=toy" in shown, shown


def test_a_stats_write_whose_reply_was_lost_and_was_sent_again_counts_once(
    clean_redis: EmbeddedRedis,
) -> None:
    """redis-py sends a pipeline again on a fresh connection when its reply is lost; the counters it
    carried were applied the first time already."""
    import redis
    import redis.client

    from carpool.coordinator.stats import CoordinatorStats, StatsWriter
    from carpool.redis_edge.keys import Keys

    class ReplyLostOnce(redis.client.Pipeline):
        lost = 0

        def _execute_pipeline(self, connection: Any, commands: Any, raise_on_error: bool) -> Any:
            replies = super()._execute_pipeline(connection, commands, raise_on_error)  # type: ignore[no-untyped-call]
            if ReplyLostOnce.lost < 1:  # applied, then the connection drops before the reply
                ReplyLostOnce.lost += 1
                raise redis.ConnectionError("reply lost")
            return replies

    class Client(redis.Redis):
        def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
            return ReplyLostOnce(self.connection_pool, self.response_callbacks, transaction, shard_hint)

    from redis.backoff import NoBackoff
    from redis.retry import Retry

    client = Client(port=clean_redis.port, retry=Retry(NoBackoff(), 1))
    keys = Keys("carpool.requests")
    stats = CoordinatorStats(taken=5, batches=1)
    stats.sizes[5] += 1
    one = StatsWriter(client, keys, "c-one", time.time)
    one.write(stats, {}, {"pending": 0})
    assert ReplyLostOnce.lost == 1  # the write went twice
    counted = {as_bytes(k).decode(): int(v) for k, v in client.hgetall(keys.stats).items()}
    assert counted == {"taken": 5, "batches": 1, "size:5": 1}

    # Without a retry the lost reply fails the write; its totals go again with the next write.
    ReplyLostOnce.lost = 0
    two = StatsWriter(Client(port=clean_redis.port, retry=Retry(NoBackoff(), 0)), keys, "c-two", time.time)
    with pytest.raises(redis.ConnectionError):
        two.write(CoordinatorStats(taken=2), {}, {"pending": 0})
    two.write(CoordinatorStats(taken=4), {}, {"pending": 0})
    assert int(as_bytes(client.hget(keys.stats, "taken"))) == 5 + 4

    # A writer idle for long keeps its applied totals: gone, its next totals would count again.
    applied = one._applied_key
    client.expire(applied, 5)
    one.write(stats, {}, {"pending": 0})  # nothing moved
    assert client.ttl(applied) > 5


def test_status_adds_up_what_two_coordinators_hold(processes: Processes) -> None:
    import redis

    from carpool.redis_edge.keys import Keys
    from carpool.tasks import infer
    from carpool.tools.status import collect

    # No worker: each coordinator holds what it takes, one request per take, so both take some.
    env = {**TOY, "CARPOOL_TAKE_MAX": "1"}
    processes.start("coordinator", "coordinator", **env)
    processes.start("coordinator2", "coordinator", **env)
    client = redis.Redis(port=server_of(processes).port)
    keys = Keys("carpool.requests")
    wait_for("both coordinators writing gauges", lambda: len(collect(client, keys).coordinators) == 2)
    texts = mixed_texts(40, seed=3)
    for text in texts:
        infer.delay(text, model="toy")
        time.sleep(0.01)
    wait_for("every request held", lambda: collect(client, keys).in_flight == len(texts))
    snap = wait_for("pending summed", lambda: (s := collect(client, keys)).pending == len(texts) and s)
    held = {name: int(client.hget(keys.gauges_of(name), "pending") or 0) for name in snap.coordinators}
    assert len(held) == 2 and sum(held.values()) == len(texts), held
    assert all(held.values()), f"one coordinator took every request: {held}"
    assert sum(snap.depth_by_bin.values()) == len(texts)
    assert snap.queued_total == 0


def test_status_says_when_redis_is_unreachable(processes: Processes) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    proc = run_status(processes, "--once", CARPOOL_BROKER_URL=dead)
    assert proc.returncode == 1
    assert "redis unavailable" in proc.stderr and dead in proc.stderr


# --- a browser on Flower's tasks page -----------------------------------------------------------------
def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


def chromium(url: str, *extra: str, timeout_s: float = 90) -> str:
    binary = chromium_binary()
    assert binary is not None
    with tempfile.TemporaryDirectory(prefix="carpool-chromium-") as profile:
        proc = subprocess.run(
            [
                binary,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                f"--user-data-dir={profile}",
                "--virtual-time-budget=5000",
                *extra,
                url,
            ],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.skipif(
    chromium_binary() is None, reason="chromium not installed (Debian/Ubuntu: apt-get install -y chromium)"
)
def test_flower_tasks_page_in_a_browser_lists_the_requests(processes: Processes, flower: Flower) -> None:
    start_stack(processes, **TOY)
    probes = wait_flower_listening(flower)
    ids = send_and_get(mixed_texts(40, seed=9))
    bad_id = send_bad_request()
    wait_for(
        "requests in flower",
        lambda: (
            (tasks := flower.tasks()).get(bad_id, {}).get("state") == "FAILURE"
            and all(tasks.get(i, {}).get("state") == "SUCCESS" for i in ids)
        ),
        timeout_s=60,
    )
    known = flower.tasks()
    site = f"http://{FLOWER_USER}:{FLOWER_PASSWORD}@127.0.0.1:{flower.port}"

    # The tasks page fills its table from /tasks/datatable by JavaScript: a real browser runs it.
    dom = chromium(f"{site}/tasks", "--dump-dom")
    rows = re.findall(r'<tr id="([0-9a-f-]{36})"[^>]*>(.*?)</tr>', dom, flags=re.S)
    assert rows, f"no task rows rendered:\n{dom[-3000:]}"
    shown = re.search(r"Showing 1 to (\d+) of ([\d,]+) tasks", dom)
    assert shown, dom[-3000:]
    assert int(shown[1]) == len(rows) and int(shown[2].replace(",", "")) == len(known)
    ours = set(ids) | set(probes) | {bad_id}
    for task_id, cells in rows:
        assert task_id in known, task_id
        if task_id in ours:
            assert ">carpool.infer</a>" in cells, cells
            assert ("SUCCESS" if task_id != bad_id else "FAILURE") in cells, cells
        else:
            assert ">carpool.run_batch</a>" in cells, cells
            assert BATCH_ARGS.search(cells), cells  # size=.. bin=.. width=.. padding=.. in the list
    assert ours & {task_id for task_id, _ in rows}, "no request on the first page"

    # One request's own page (server-rendered): its name, state, text and the worker that ran it.
    one = ids[len(ids) // 2]
    page = chromium(f"{site}/task/{one}", "--dump-dom")
    assert "carpool.infer" in page and "SUCCESS" in page and one in page
    assert known[one]["args"][:30] in page.replace("&#39;", "'").replace("&amp;", "&")
    assert "carpool-gpu-" in page

    # The failed request shows its error.
    page = chromium(f"{site}/task/{bad_id}", "--dump-dom")
    assert "FAILURE" in page and "InvalidInput" in page

    shots = os.environ.get("CARPOOL_SCREENSHOT_DIR")
    if shots:  # docs/img/*.png: CARPOOL_SCREENSHOT_DIR=docs/img pytest -k browser
        Path(shots).mkdir(parents=True, exist_ok=True)
        batch = next(i for i, t in known.items() if t["name"] == "carpool.run_batch")
        pages = (
            ("flower-tasks", "/tasks"),
            ("flower-request", f"/task/{one}"),
            ("flower-batch", f"/task/{batch}"),
        )
        for name, path in pages:
            target = Path(shots).resolve() / f"{name}.png"
            chromium(site + path, f"--screenshot={target}", "--window-size=1600,900", "--hide-scrollbars")
            assert target.exists() and target.stat().st_size > 10_000

"""Checks a running compose stack from the host, then crashes its services one at a time.

Run by .ci/compose-stack.sh once `docker compose --profile cpu up --wait` has returned; it reads the
stack's coordinates from the environment the script exported (COMPOSE_PROJECT_NAME, REDIS_PASSWORD,
FLOWER_USER/FLOWER_PASSWORD, REDIS_PORT, METRICS_PORT, FLOWER_PORT) and talks to the published ports
as an outside producer would. Each check prints one line; the first failure ends the run (exit 1).
"""

from __future__ import annotations

import argparse
import base64
import functools
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ["docker", "compose", "--env-file", "/dev/null", "-f", "docker-compose.yml"]
GPU_OVERRIDE_MARKER = "# docker-compose.override.yml: one worker per GPU"
TOLERANCE = 1e-4  # largest difference allowed between an embedding and the in-process model's
DEMO_REQUESTS = 300  # `carpool demo --external --requests 300`, as the compose file runs it
CRASHED = ("coordinator", "worker-cpu", "redis")
DEADLINE_S = 900  # of every request this checker sends


class CheckFailed(Exception):
    """Raised when the stack does not do what a check expects."""


@contextmanager
def step(name: str) -> Iterator[None]:
    started = time.monotonic()
    print(f"compose-check: {name} ...", flush=True)
    try:
        yield
    except Exception as exc:
        print(f"compose-check: FAILED {name} after {time.monotonic() - started:.1f} s: {exc}", flush=True)
        raise
    print(f"compose-check: ok {name} ({time.monotonic() - started:.1f} s)", flush=True)


def wait_for(what: str, probe: Callable[[], T | None], timeout_s: float, every_s: float = 0.5) -> T:
    """``probe()``'s first truthy answer; exceptions count as "not yet" until the deadline."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        try:
            answer = probe()
            if answer:
                return answer
        except Exception as exc:
            last = exc
        if time.monotonic() > deadline:
            raise CheckFailed(f"timed out after {timeout_s:.0f} s waiting for {what} (last: {last!r})")
        time.sleep(every_s)


def http_get(url: str, auth: tuple[str, str] | None = None) -> tuple[int, bytes]:
    headers = {}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(":".join(auth).encode()).decode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as resp:
            return resp.status, bytes(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def texts_of_mixed_length(n: int, seed: int) -> list[str]:
    """Distinct texts of 3 to 300 words, the longest past the model's window (so truncated)."""
    rng = random.Random(seed)
    words = [
        "the",
        "coordinator",
        "drains",
        "requests",
        "into",
        "padded",
        "micro",
        "batches",
        "for",
        "a",
        "worker",
    ]
    out = []
    for i in range(n):
        count = rng.choice([rng.randint(3, 20), rng.randint(21, 80), rng.randint(81, 300)])
        out.append(f"Request {i} of seed {seed}: " + " ".join(rng.choice(words) for _ in range(count)))
    return out


@dataclass
class Stack:
    """The compose project under test, seen from the host."""

    compose: list[str]
    redis_port: int
    metrics_port: int
    flower_port: int
    redis_password: str
    flower_auth: tuple[str, str]
    restarts: dict[str, int] = field(default_factory=dict)

    def container(self, service: str) -> str:
        out = subprocess.run([*self.compose, "ps", "-q", service], capture_output=True, text=True, check=True)
        ids = out.stdout.split()
        if len(ids) != 1:
            raise CheckFailed(f"expected one {service} container, found {ids}")
        return ids[0]

    def inspect(self, service: str, template: str) -> str:
        out = subprocess.run(
            ["docker", "inspect", "-f", template, self.container(service)],
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()

    def restart_count(self, service: str) -> int:
        return int(self.inspect(service, "{{.RestartCount}}"))

    def kill_main_process(self, service: str) -> None:
        """SIGKILL the container's main process from the host: a crash, which the restart policy
        answers (`docker kill` counts as a manual stop, after which Docker never restarts)."""
        pid = int(self.inspect(service, "{{.State.Pid}}"))
        if pid <= 0:
            raise CheckFailed(f"{service} is not running")
        os.kill(pid, signal.SIGKILL)

    def healthy(self, service: str) -> bool:
        return self.inspect(service, "{{.State.Status}} {{.State.Health.Status}}") == "running healthy"

    def redis_url(self, db: int, password: str | None = None) -> str:
        secret = self.redis_password if password is None else password
        return f"redis://:{secret}@127.0.0.1:{self.redis_port}/{db}"

    def flower_tasks(self) -> dict[str, dict[str, Any]]:
        status, body = http_get(
            f"http://127.0.0.1:{self.flower_port}/api/tasks?taskname=carpool.infer", self.flower_auth
        )
        if status != 200:
            raise CheckFailed(f"flower answered {status} with its password")
        return dict(json.loads(body))


class Results:
    """Results read straight from the result backend with GET: no pub/sub to lose when Redis dies."""

    def __init__(self, backend_url: str) -> None:
        import redis

        from carpool.celery_app import app

        self._backend = app.backend
        self._client = redis.Redis.from_url(backend_url)

    def done(self, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        raw = self._client.mget([self._backend.get_key_for_task(i) for i in ids])
        return {i: self._backend.decode_result(r) for i, r in zip(ids, raw, strict=True) if r is not None}

    def wait_all(self, ids: Sequence[str], timeout_s: float) -> dict[str, dict[str, Any]]:
        def all_done() -> dict[str, dict[str, Any]] | None:
            found = self.done(ids)
            return found if len(found) == len(ids) else None

        return wait_for(f"{len(ids)} results", all_done, timeout_s)


def reference_embeddings(texts: Sequence[str], batch: int = 16) -> dict[str, np.ndarray]:
    """The model run in this process on length-sorted padded batches (padding moves an embedding by
    orders of magnitude less than TOLERANCE)."""
    import torch

    from carpool.models import get_model

    torch.set_num_threads(1)  # the stack's worker runs on the same cores; don't fight it for them
    model = get_model("minilm")
    model.load("cpu")
    unique = list(dict.fromkeys(texts))
    encoded = sorted(zip(model.encode(unique), unique, strict=True), key=lambda pair: len(pair[0]))
    out = {}
    for start in range(0, len(encoded), batch):
        chunk = encoded[start : start + batch]
        width = len(chunk[-1][0])
        ids = np.full((len(chunk), width), model.pad_id, dtype=np.int64)
        mask = np.zeros((len(chunk), width), dtype=np.int64)
        for row, (tokens, _) in enumerate(chunk):
            ids[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = 1
        for (_, text), vector in zip(chunk, model.forward(ids, mask), strict=True):
            out[text] = np.array(vector, dtype=np.float32)
    return out


def check_results(
    found: dict[str, dict[str, Any]], sent: dict[str, str], reference: dict[str, np.ndarray]
) -> None:
    worst = 0.0
    for task_id, text in sent.items():
        meta = found[task_id]
        if meta.get("status") != "SUCCESS":
            raise CheckFailed(f"request {task_id} ended {meta.get('status')}: {meta.get('result')}")
        got = np.array(meta["result"], dtype=np.float32)
        if got.shape != reference[text].shape:
            raise CheckFailed(f"request {task_id}: embedding of shape {got.shape}")
        worst = max(worst, float(np.abs(got - reference[text]).max()))
    if worst >= TOLERANCE:
        raise CheckFailed(f"an embedding differs from the in-process model by {worst:.2e}")
    print(f"compose-check:    {len(sent)} embeddings within {worst:.1e} of the in-process model", flush=True)


def submit(texts: Sequence[str]) -> dict[str, str]:
    """Each text through ``infer``, with a deadline that outlasts a crashed process's recovery.

    A request held by a killed process returns after CARPOOL_RECOVERY_TIMEOUT_S, and on a busy
    machine the default deadline can pass first: the request then fails as expired, which is the
    deadline working, not a loss. These checks are about answers, so they wait for them.
    """
    from carpool.tasks import infer

    return {infer.apply_async((text,), expires=DEADLINE_S).id: text for text in texts}


def documented_gpu_override() -> str:
    """The override docs/OPERATIONS.md gives for one worker per GPU."""
    text = (ROOT / "docs" / "OPERATIONS.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if b.startswith(GPU_OVERRIDE_MARKER)]
    if len(blocks) != 1:
        raise CheckFailed(f"docs/OPERATIONS.md has {len(blocks)} blocks starting {GPU_OVERRIDE_MARKER!r}")
    return str(blocks[0])


def check_gpu_override() -> None:
    """Compose itself merges the documented override: each GPU worker reserves one GPU of its own.

    Merging appends device requests, so an override without ``!override`` would leave every worker
    with GPU 0 as well as its own.
    """
    with step("the documented one-worker-per-GPU override gives each worker its own GPU"):
        # In the repository root: the override's `extends: {file: docker-compose.yml}` is relative.
        with tempfile.NamedTemporaryFile("w", suffix=".yml", dir=ROOT, prefix=".gpu-override-") as override:
            override.write(documented_gpu_override())
            override.flush()
            out = subprocess.run(
                [*COMPOSE, "-f", override.name, "config", "--format", "json"],
                capture_output=True,
                text=True,
                cwd=ROOT,
            )
        if out.returncode != 0:
            raise CheckFailed(f"docker compose config refused the override: {out.stderr.strip()}")
        services = json.loads(out.stdout)["services"]
        gpus: dict[str, list[str]] = {}
        for name, svc in services.items():
            if svc.get("command", [])[:2] != ["carpool", "worker"] or "cpu" in svc.get("profiles", []):
                continue
            devices = svc["deploy"]["resources"]["reservations"]["devices"]
            if len(devices) != 1 or devices[0].get("count") or len(devices[0].get("device_ids", [])) != 1:
                raise CheckFailed(f"{name} reserves {devices}, not exactly one GPU by id")
            gpus[name] = devices[0]["device_ids"]
            if svc.get("environment", {}).get("CUDA_VISIBLE_DEVICES", "0") != "0":
                raise CheckFailed(f"{name}: its one GPU is device 0 inside the container")
        ids = [i for ids in gpus.values() for i in ids]
        if len(gpus) < 2 or len(set(ids)) != len(ids):
            raise CheckFailed(f"GPU workers and their devices: {gpus}")
        print(f"compose-check:    {gpus}", flush=True)


def check_security_and_metrics(stack: Stack) -> None:
    import redis

    with step("Redis refuses a client without the password, or with a wrong one"):
        for password in ("", "wrong-" + stack.redis_password):
            try:
                redis.Redis.from_url(stack.redis_url(0, password)).ping()
            except redis.AuthenticationError:
                continue
            except redis.ResponseError as exc:  # NOAUTH on servers that see no AUTH at all
                if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
                    continue
                raise
            raise CheckFailed("Redis answered PING without the right password")
        if not redis.Redis.from_url(stack.redis_url(0)).ping():
            raise CheckFailed("Redis refuses its own password")

    with step("the coordinator's metrics endpoint serves carpool_ series"):
        status, body = http_get(f"http://127.0.0.1:{stack.metrics_port}/metrics")
        series = {line.split("{")[0].split()[0] for line in body.decode().splitlines() if line[:1].isalpha()}
        carpool_series = sorted(s for s in series if s.startswith("carpool_"))
        if status != 200 or not carpool_series:
            raise CheckFailed(f"/metrics answered {status} with no carpool_ series")
        print(f"compose-check:    {len(carpool_series)} series, e.g. {carpool_series[:3]}", flush=True)

    with step("Flower answers 401 without auth or with a wrong password, 200 with it"):
        base = f"http://127.0.0.1:{stack.flower_port}"
        for path in ("/api/tasks", "/tasks", "/api/workers"):
            for auth in (None, (stack.flower_auth[0], "wrong")):
                status, _ = http_get(base + path, auth)
                if status != 401:
                    raise CheckFailed(f"GET {path} with auth {auth and auth[0]!r} answered {status}")
        stack.flower_tasks()


def check_demo_burst(
    stack: Stack, results: Results, texts: list[str], reference: dict[str, np.ndarray]
) -> None:
    with step("Flower's event receiver is listening (a probe request shows up)"):

        def probe_listed() -> bool:
            probe = submit(["a probe for flower"])
            results.wait_all(list(probe), 60)
            return wait_for_quietly(lambda: next(iter(probe)) in stack.flower_tasks(), 3)

        wait_for("flower to list a probe", probe_listed, 90, every_s=0)
        before = set(stack.flower_tasks())

    with step(f"the demo service (`carpool demo --external --requests {DEMO_REQUESTS}`) exits 0"):
        subprocess.run(
            [*stack.compose, "--profile", "demo", "run", "--rm", "-T", "--no-deps", "demo"], check=True
        )

    with step(f"a burst of {len(texts)} requests from the host: every embedding right"):
        sent = submit(texts)
        check_results(results.wait_all(list(sent), 300), sent, reference)

    with step("Flower lists every demo request and every host request as SUCCESS"):

        def all_listed() -> dict[str, dict[str, Any]] | None:
            tasks = stack.flower_tasks()
            missing = [i for i in sent if tasks.get(i, {}).get("state") != "SUCCESS"]
            demo = {i: t for i, t in tasks.items() if i not in before and i not in sent}
            if missing or len(demo) < DEMO_REQUESTS + 1:
                return None
            return demo

        demo = wait_for("every request listed as SUCCESS", all_listed, 60)
        states = {t.get("state") for t in demo.values()}
        # The demo sends one warm-up request before its burst.
        if len(demo) != DEMO_REQUESTS + 1 or states != {"SUCCESS"}:
            raise CheckFailed(f"flower lists {len(demo)} demo requests in states {states}")


def wait_for_quietly(probe: Callable[[], bool], timeout_s: float) -> bool:
    try:
        return wait_for("", probe, timeout_s, every_s=0.2)
    except CheckFailed:
        return False


def check_crashes(stack: Stack, results: Results, texts: list[str], reference: dict[str, np.ndarray]) -> None:
    """A second burst in one wave per service; each wave's service is SIGKILLed while it serves."""
    sent: dict[str, str] = {}
    for service in CRASHED:
        with step(f"kill -9 {service}'s main process while it serves {len(texts)} requests; it restarts"):
            before = stack.restart_count(service)
            ids = submit(texts)
            sent.update(ids)

            def under_way(ids: dict[str, str] = ids) -> bool:
                return len(results.done(list(ids))) >= len(ids) // 5

            def restarted(service: str = service, before: int = before) -> int | None:
                count = stack.restart_count(service)
                running = stack.inspect(service, "{{.State.Running}}") == "true"
                return count if count > before and running else None

            # Kill once the wave is flowing, so the crash lands in the middle of work.
            wait_for("the wave to be under way", under_way, 120, every_s=0.05)
            answered = len(results.done(list(ids)))
            stack.kill_main_process(service)
            if answered == len(ids):
                raise CheckFailed(f"the whole wave was answered before {service} died: no crash mid-work")
            print(f"compose-check:    killed with {answered} of {len(ids)} answered", flush=True)
            count = wait_for(f"{service} to restart", restarted, 60)
            stack.restarts[service] = count - before
    with step(f"nothing lost: all {len(sent)} requests of the second burst answered right"):
        check_results(results.wait_all(list(sent), 300), sent, reference)
    with step("every service healthy again, restart counts up"):
        for service in ("redis", "coordinator", "worker-cpu", "flower"):
            wait_for(f"{service} healthy", functools.partial(stack.healthy, service), 180, every_s=2)
        print(f"compose-check:    restarts {stack.restarts}", flush=True)
        if set(stack.restarts) != set(CRASHED) or min(stack.restarts.values()) < 1:
            raise CheckFailed(f"restart counts {stack.restarts}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=180, help="texts per burst sent from the host")
    parser.add_argument("--skip-crashes", action="store_true", help="stop after the first burst")
    args = parser.parse_args(argv)
    env = os.environ
    stack = Stack(
        compose=[*COMPOSE, "--profile", "cpu"],
        redis_port=int(env["REDIS_PORT"]),
        metrics_port=int(env["METRICS_PORT"]),
        flower_port=int(env["FLOWER_PORT"]),
        redis_password=env["REDIS_PASSWORD"],
        flower_auth=(env["FLOWER_USER"], env["FLOWER_PASSWORD"]),
    )
    # The producer in this process reaches the stack's Redis through its published port.
    os.environ["CARPOOL_BROKER_URL"] = stack.redis_url(0)
    os.environ["CARPOOL_RESULT_BACKEND"] = stack.redis_url(1)
    started = time.monotonic()
    try:
        check_gpu_override()
        check_security_and_metrics(stack)
        texts = texts_of_mixed_length(args.requests, seed=15)
        with step(f"the model in this process embeds the {len(texts)} texts"):
            reference = reference_embeddings(texts)
        results = Results(stack.redis_url(1))
        check_demo_burst(stack, results, texts, reference)
        if not args.skip_crashes:
            check_crashes(stack, results, texts, reference)
    except (CheckFailed, subprocess.CalledProcessError) as exc:
        print(f"compose-check: FAILED: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"compose-check: all checks passed in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

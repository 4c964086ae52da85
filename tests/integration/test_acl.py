"""Least-privilege Redis users (``carpool acl``) on a real redis-server.

Each role serves with its own user (a stack whose coordinator, worker, Flower and producer all use
role users answers every kind of request, and Redis logs no denial), and a producer's user cannot
read in-flight state, delete queues, or read or overwrite results it cannot name.
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.exceptions import NoPermissionError

from carpool.config import load_settings
from carpool.redis_edge.keys import Keys
from carpool.redis_edge.store import RequestStore
from carpool.tools import acl
from carpool.tools.embedded import EmbeddedRedis, free_port, redis_server_binary
from tests.integration.conftest import Processes, server_of, wait_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
KEYS = Keys("carpool.requests")
TOY = {"CARPOOL_MODEL": "toy", "CARPOOL_MODELS": "toy"}
PASSWORDS: dict[str, str] = {role: f"{role}-secret-pw" for role in acl.ROLES}
RESULT_ID = "5f0c3b36-0c4e-4a47-9b1e-2e8f6d1c9a10"
FLOWER_AUTH = ("user", "pass")

# The producer runs in a process of its own, so its Celery app is built from the producer's URLs.
PRODUCER = """
import asyncio, json
import carpool
from celery import chain
from carpool.celery_app import app
from carpool.tasks import infer

out = {}
out["delay"] = infer.delay("hello acl", model="toy").get(timeout=60)
out["priority"] = infer.apply_async(("hello acl",), {"model": "toy"}, priority=9).get(timeout=60)
out["gather"] = carpool.gather(carpool.submit_many(["one", "two", "hello acl"], model="toy"), timeout=60)
pending = carpool.submit_many(["three", "hello acl"], model="toy", subscribe=False)
out["gather_async"] = asyncio.run(carpool.gather_async(pending, timeout=60))
sent = app.send_task("carpool.infer", args=["hello acl", "toy"])
out["send_task"] = sent.get(timeout=60)
out["send_task_id"] = sent.id
# The worker sends the chain's second step, on its own user.
steps = chain(infer.s("one", model="toy"), infer.si("hello acl", model="toy"))
out["chain"] = steps.apply_async().get(timeout=60)
rejected = app.send_task("carpool.infer", args=["fine", "nope"])
out["rejected"] = repr(rejected.get(timeout=60, propagate=False))
print(json.dumps(out))
"""


def user(role: str) -> str:
    return acl.DEFAULT_USER_PREFIX + role


def url(server: EmbeddedRedis, role: str, db: int) -> str:
    return f"redis://{user(role)}:{PASSWORDS[role]}@127.0.0.1:{server.port}/{db}"


def role_env(server: EmbeddedRedis, role: str) -> dict[str, str]:
    return {"CARPOOL_BROKER_URL": url(server, role, 0), "CARPOOL_RESULT_BACKEND": url(server, role, 1)}


def require_redis_7(client: redis.Redis) -> None:
    version = str(client.info("server")["redis_version"])
    if int(version.split(".")[0]) < 7:
        pytest.skip(f"ACL selectors need Redis 7+, this redis-server is {version}")


def denials(client: redis.Redis) -> list[dict[str, Any]]:
    return [e for e in client.acl_log(128) if str(e.get("username", "")).startswith(acl.DEFAULT_USER_PREFIX)]


@pytest.fixture()
def role_users(clean_redis: EmbeddedRedis) -> Iterator[redis.Redis]:
    """The four role users on the session's server (the default user keeps every permission); removed
    afterwards, so later tests see the server as before. Yields an admin client."""
    admin = redis.Redis(port=clean_redis.port)
    require_redis_7(admin)
    for role, role_acl in acl.role_acls(load_settings()).items():
        rules = acl.user_rules(role_acl, PASSWORDS[role])
        admin.execute_command("ACL", "SETUSER", user(role), *rules)  # type: ignore[no-untyped-call]
    admin.acl_log_reset()
    try:
        yield admin
    finally:
        for role in acl.ROLES:
            admin.acl_deluser(user(role))
        admin.acl_log_reset()
        admin.close()


def flower_get(port: int, path: str) -> Any:
    token = base64.b64encode(":".join(FLOWER_AUTH).encode()).decode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"Basic {token}"}
    )
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read())


@pytest.fixture()
def flower(role_users: redis.Redis, processes: Processes, tmp_path: Path) -> Iterator[int]:
    """Flower on the flower role's user; yields its port once it answers."""
    port = free_port()
    log_path = tmp_path / "flower.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                *("-m", "celery", "-A", "carpool.celery_app", "flower"),
                *(f"--port={port}", "--address=127.0.0.1", f"--basic-auth={':'.join(FLOWER_AUTH)}"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=processes.env(**TOY, **role_env(server_of(processes), "flower")),
            cwd=REPO,
        )
    try:
        wait_for(
            "flower answering",
            lambda: proc.poll() is None and flower_get(port, "/api/tasks?limit=1") == {},
            timeout_s=60,
        )
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.returncode not in (0, -15):
            print(log_path.read_text(errors="replace")[-4000:])


def test_every_role_serves_with_its_own_user(
    role_users: redis.Redis, processes: Processes, flower: int
) -> None:
    # role_users first: its teardown deletes the users, which must outlive the processes using them.
    server = server_of(processes)
    processes.start("coordinator", "coordinator", **TOY, **role_env(server, "coordinator"))
    processes.start("worker0", "worker", **TOY, **role_env(server, "worker"))
    processes.wait_workers(1)
    produced = subprocess.run(
        [sys.executable, "-c", PRODUCER],
        env=processes.env(**TOY, **role_env(server, "producer")),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert produced.returncode == 0, produced.stderr[-4000:]
    out = json.loads(produced.stdout.strip().splitlines()[-1])
    vector = out["delay"]
    assert len(vector) == 32
    assert out["priority"] == vector
    assert out["gather"][2] == vector and len(out["gather"]) == 3
    assert out["gather_async"][1] == vector and len(out["gather_async"]) == 2
    assert out["send_task"] == vector
    assert out["chain"] == vector
    assert "UnknownModel" in out["rejected"]  # stored by the coordinator on its own user

    # Flower heard the events, inspected the worker and reads a result, all on its own user.
    task_id = out["send_task_id"]
    # Its received event leaves with the dispatch, its succeeded event with the result: wait for both.
    info = wait_for(
        "the request in flower, succeeded",
        lambda: (i := flower_get(flower, f"/api/task/info/{task_id}")).get("state") == "SUCCESS" and i,
        60,
    )
    assert info["state"] == "SUCCESS"
    workers = wait_for("the worker in flower", lambda: flower_get(flower, "/api/workers?refresh=1"), 60)
    assert any(name.startswith("carpool-gpu-") for name in workers)
    assert flower_get(flower, f"/api/task/result/{task_id}")["result"] == vector

    # docker-compose's worker healthcheck, on the worker's user.
    worker = redis.Redis.from_url(url(server, "worker", 0))
    seconds, micros = worker.time()
    assert worker.zrangebyscore(KEYS.workers, seconds * 1000 + micros // 1000, "+inf")
    worker.close()

    # Its heartbeat, on its user, names the batch queue it consumes; a coordinator reads that on its own.
    coordinator = redis.Redis.from_url(url(server, "coordinator", 0))
    found = RequestStore(coordinator, KEYS, 1).batch_queue_workers()
    coordinator.close()
    assert list(found.by_queue) == ["carpool.batches"] and not found.unknown

    # Each process really connected as its role (a URL whose user was dropped would run as default).
    connected = {str(c.get("user")) for c in role_users.client_list()}
    assert {user("coordinator"), user("worker"), user("flower")} <= connected

    # A revoke: the coordinator records it on its own user, and the worker's Celery marks it REVOKED
    # in the results (reading the meta first) on its own (refusals there are only logged).
    from carpool.celery_edge.app import app as carpool_app

    carpool_app.control.revoke("revoked-under-acl")
    wait_for(
        "the revoke recorded", lambda: role_users.zscore(KEYS.revoked, "revoked-under-acl") is not None, 10
    )

    # Nothing was refused anywhere (fallback paths that swallow errors would hide it otherwise).
    assert denials(role_users) == []


def test_producer_user_cannot_read_delete_or_overwrite(role_users: redis.Redis) -> None:
    admin = role_users
    server_port = admin.connection_pool.connection_kwargs["port"]
    admin.hset(KEYS.inflight_raw, "req-1", b'{"secret": "someone else\'s text"}')
    admin.zadd(KEYS.inflight_lease, {"req-1": 1})
    admin.lpush(KEYS.dead_letter, b"dead")
    admin.lpush("carpool.requests", b"queued")
    results_admin = redis.Redis(port=server_port, db=1)
    result_key = f"celery-task-meta-{RESULT_ID}"
    results_admin.set(result_key, b'{"status": "SUCCESS", "result": [1.0]}')
    broker = redis.Redis(port=server_port, username=user("producer"), password=PASSWORDS["producer"])
    results = redis.Redis(
        port=server_port, db=1, username=user("producer"), password=PASSWORDS["producer"], protocol=2
    )

    # What it may do: push a request, read a result it names.
    assert broker.lpush("carpool.requests", b"mine") == 2
    assert results.get(result_key) == b'{"status": "SUCCESS", "result": [1.0]}'

    refused: dict[str, Callable[[], object]] = {
        "read in-flight state": lambda: broker.hgetall(KEYS.inflight_raw),
        "read one in-flight request": lambda: broker.hget(KEYS.inflight_raw, "req-1"),
        "read the lease set": lambda: broker.zrange(KEYS.inflight_lease, 0, -1),
        "count the dead letters": lambda: broker.llen(KEYS.dead_letter),
        "take a request": lambda: broker.rpop("carpool.requests"),
        "read the queue": lambda: broker.lrange("carpool.requests", 0, -1),
        "delete the queue": lambda: broker.delete("carpool.requests"),
        "delete in-flight state": lambda: broker.delete(KEYS.inflight_raw),
        "list results (KEYS)": lambda: results.keys("celery-task-meta-*"),
        "list results (SCAN)": lambda: results.scan(0, match="celery-task-meta-*"),
        "overwrite a result": lambda: results.set(result_key, b"forged"),
        "delete a result": lambda: results.delete(result_key),
        "push onto a result key": lambda: results.lpush(f"celery-task-meta-{RESULT_ID[::-1]}", b"x"),
        "forge a result message": lambda: results.publish(result_key, b"forged"),
        "flush the results": lambda: results.flushdb(),
        "flush everything": lambda: broker.flushall(),
        "run a script": lambda: broker.eval("return 1", 0),
    }
    for what, call in refused.items():
        with pytest.raises(NoPermissionError):
            call()
            pytest.fail(f"the producer's user could {what}")

    # Pub/sub: it may await a result by name, never every result or others' events (their texts).
    connection = results.connection_pool.get_connection()
    try:
        connection.send_command("SUBSCRIBE", result_key)  # type: ignore[no-untyped-call]
        assert connection.read_response()[0] in (b"subscribe", "subscribe")
        connection.send_command("PSUBSCRIBE", "celery-task-meta-*")  # type: ignore[no-untyped-call]
        with pytest.raises(NoPermissionError):
            connection.read_response()
        connection.send_command("SUBSCRIBE", "/0.celeryev/task.multi")  # type: ignore[no-untyped-call]
        with pytest.raises(NoPermissionError):
            connection.read_response()
    finally:
        connection.disconnect()  # type: ignore[no-untyped-call]
        results.connection_pool.release(connection)

    assert admin.hget(KEYS.inflight_raw, "req-1") is not None
    assert results_admin.get(result_key) == b'{"status": "SUCCESS", "result": [1.0]}'
    assert admin.llen("carpool.requests") == 2
    for client in (broker, results, results_admin):
        client.close()


@pytest.fixture()
def aclfile_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A redis-server of its own, started with ``--aclfile`` written by ``carpool acl``; yields its port."""
    from carpool.cli import main

    monkeypatch.setenv("REDIS_PASSWORD", "admin-pw")
    for role, password in PASSWORDS.items():
        monkeypatch.setenv(acl.role_password_env(role), password)
    path = tmp_path / "users.acl"
    with open(path, "w") as out, pytest.MonkeyPatch.context() as m:
        m.setattr(sys, "stdout", out)
        assert main(["acl", "--format", "aclfile"]) == 0
    port = free_port()
    proc = subprocess.Popen(
        [
            *(redis_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--aclfile", str(path)),
            *("--save", "", "--appendonly", "no", "--dir", str(tmp_path)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        client = redis.Redis(port=port, password="admin-pw", socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None:
                    err = proc.stderr.read().decode() if proc.stderr else ""
                    pytest.fail(f"redis-server did not start with the aclfile: {err}")
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        require_redis_7(client)
        client.close()
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        if proc.stderr:
            proc.stderr.close()


def test_aclfile_loads_and_keeps_the_default_password(aclfile_server: int) -> None:
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=aclfile_server).ping()  # requirepass is not what guards the default user here
    admin = redis.Redis(port=aclfile_server, password="admin-pw")
    assert set(admin.acl_users()) >= {user(r) for r in acl.ROLES} | {"default"}
    producer = redis.Redis(port=aclfile_server, username=user("producer"), password=PASSWORDS["producer"])
    assert producer.lpush("carpool.requests\x06\x169", b"x") == 1  # the raw separator came through
    with pytest.raises(NoPermissionError):
        producer.lpush("carpool.requests\x06\x168", b"x")
    with pytest.raises(NoPermissionError):
        producer.hgetall(KEYS.inflight_raw)
    admin.close()
    producer.close()


@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="no redis-cli on PATH")
def test_commands_format_through_redis_cli_equals_the_rules(role_users: redis.Redis) -> None:
    admin = role_users
    port = admin.connection_pool.connection_kwargs["port"]
    text = acl.render(
        load_settings(),
        list(acl.ROLES),
        "commands",
        {acl.role_password_env(r): p for r, p in PASSWORDS.items()},
        prefix="cli-",
    )
    try:
        done = subprocess.run(
            ["redis-cli", "-p", str(port)], input=text, capture_output=True, text=True, timeout=30
        )
        assert done.stdout.split() == ["OK"] * len(acl.ROLES), done.stdout + done.stderr
        for role in acl.ROLES:
            via_cli = admin.acl_getuser(f"cli-{role}")
            direct = admin.acl_getuser(user(role))
            assert via_cli == direct, role
    finally:
        for role in acl.ROLES:
            admin.acl_deluser(f"cli-{role}")


def test_urls_with_a_user_reach_redis_as_that_user(role_users: redis.Redis) -> None:
    """redis-py, kombu and Celery's backend all take the user from ``redis://user:pass@host/db``."""
    from carpool.celery_edge.app import create_app

    server_port = role_users.connection_pool.connection_kwargs["port"]
    settings = load_settings(
        broker_url=f"redis://{user('producer')}:{PASSWORDS['producer']}@127.0.0.1:{server_port}/0",
        result_backend=f"redis://{user('producer')}:{PASSWORDS['producer']}@127.0.0.1:{server_port}/1",
    )
    app = create_app(settings)
    with app.connection_for_write() as conn:
        kombu_client = conn.default_channel.client
        clients = {"kombu": kombu_client, "backend": app.backend.client}
        clients["redis-py"] = redis.Redis.from_url(settings.broker_url)
        for name, client in clients.items():
            client.ping()  # the producer's password, which the default user would refuse
            with pytest.raises(NoPermissionError):  # and the producer's permissions
                client.keys("*")
                pytest.fail(f"{name} connected as the default user")


def test_a_coordinator_user_without_blmove_stops_the_coordinator_saying_so(
    role_users: redis.Redis, processes: Processes
) -> None:
    rules = acl.user_rules(acl.role_acls(load_settings())["coordinator"], PASSWORDS["coordinator"])
    role_users.execute_command("ACL", "SETUSER", user("coordinator"), *rules, "-blmove")  # type: ignore[no-untyped-call]
    proc = processes.start(
        "coordinator", "coordinator", **TOY, **role_env(server_of(processes), "coordinator")
    )
    assert proc.wait(timeout=60) == 2, "a ConfigError, not a coordinator polling on without it"
    log = processes.log("coordinator")
    assert "may not BLMOVE" in log and "carpool-coordinator" in log and "'blmove'" in log, log


def send_one(server: EmbeddedRedis) -> None:
    """One toy request, sent on the default user."""
    from carpool.celery_edge.app import create_app
    from carpool.producer.submit import submit_many

    settings = load_settings(
        broker_url=server.url(0), result_backend=server.url(1), model="toy", models=("toy",)
    )
    app = create_app(settings)
    try:
        submit_many(["hello acl"], app=app, subscribe=False)
    finally:
        app.close()


def without(role_users: redis.Redis, role: acl.Role, *commands: str) -> None:
    """``role``'s rules less ``commands``: a user an older release's rules would give."""
    rules = acl.user_rules(acl.role_acls(load_settings())[role], PASSWORDS[role])
    denied = [f"-{command}" for command in commands]
    role_users.execute_command("ACL", "SETUSER", user(role), *rules, *denied)  # type: ignore[no-untyped-call]


@pytest.mark.parametrize(
    ("missing", "handed_back"),
    [
        (("hsetnx",), 1),  # dispatch's, since 2026-12-04
        # An aclfile from before 2026-12-01: the hand-back's requeue is refused too, and the error
        # that stops it is still the one it says (the request returns after its lease).
        (("zmscore", "hmget"), 0),
    ],
)
def test_a_coordinator_user_missing_a_command_its_scripts_call_stops_it_saying_what_to_do(
    role_users: redis.Redis, processes: Processes, missing: tuple[str, ...], handed_back: int
) -> None:
    without(role_users, "coordinator", *missing)
    server = server_of(processes)
    proc = processes.start("coordinator", "coordinator", **TOY, **role_env(server, "coordinator"))
    processes.start("worker0", "worker", **TOY, **role_env(server, "worker"))
    processes.wait_workers(1)
    send_one(server)
    assert proc.wait(timeout=60) == 2, "a ConfigError, not a coordinator retrying the step for ever"
    log = processes.log("coordinator")
    assert "may not run a command carpool calls" in log and "carpool acl --role coordinator" in log, log
    assert repr(user("coordinator")) in log, log
    assert role_users.llen(KEYS.request_queue) == handed_back


@pytest.mark.parametrize(
    ("missing", "answered"),
    [
        ("hsetnx", 0),  # claim's, since 2026-12-04
        ("ltrim", 1),  # finish's, for the batch report: the result and its ack come before it
    ],
)
def test_a_worker_user_missing_a_command_its_scripts_call_stops_it_saying_what_to_do(
    role_users: redis.Redis, processes: Processes, missing: str, answered: int
) -> None:
    without(role_users, "worker", missing)
    server = server_of(processes)
    processes.start("coordinator", "coordinator", **TOY, **role_env(server, "coordinator"))
    proc = processes.start("worker0", "worker", **TOY, **role_env(server, "worker"))
    processes.wait_workers(1)
    send_one(server)
    assert proc.wait(timeout=60) == 2, "a worker that stops, not one failing each batch for ever"
    log = (processes.log_dir / "worker0.log").read_text(errors="replace")  # all of it
    assert "may not run a command carpool calls" in log and repr(user("worker")) in log, log
    assert "carpool acl --role worker" in log and "this worker stops" in log, log
    # The request is not lost: answered, or waiting in flight (a coordinator recovers it when its
    # lease runs out) for a worker whose user may claim it.
    results = redis.Redis(port=server.port, db=1)
    assert len(results.keys("celery-task-meta-*")) == answered
    assert role_users.hlen(KEYS.inflight_raw) == 1 - answered
    results.close()


@pytest.mark.parametrize("role", ["coordinator", "worker"])
def test_rules_from_before_the_workers_said_their_batch_queues_stop_the_process_saying_what_to_do(
    role_users: redis.Redis, processes: Processes, role: acl.Role
) -> None:
    # Rules of an earlier release lack the worker queues hash, which workers write with their
    # heartbeat (since 2026-12-06) and coordinators read.
    queues = KEYS.worker_queues
    rules = acl.user_rules(acl.role_acls(load_settings())[role], PASSWORDS[role])
    older = [r.replace(f" ~{queues}", "").replace(f" %R~{queues}", "") for r in rules if r != f"~{queues}"]
    assert not any(queues in r for r in older)
    role_users.execute_command("ACL", "SETUSER", user(role), *older)  # type: ignore[no-untyped-call]
    server = server_of(processes)
    proc = processes.start(role, role, **TOY, **role_env(server, role))
    assert proc.wait(timeout=90) == 2, "a ConfigError that says what to run"
    log = (processes.log_dir / f"{role}.log").read_text(errors="replace")
    assert "may not run a command carpool calls" in log and f"carpool acl --role {role}" in log, log


def test_the_demo_measures_on_a_producers_user_without_the_batch_figures(role_users: redis.Redis) -> None:
    from carpool.tools.demo import coordinator_stats

    port = role_users.connection_pool.connection_kwargs["port"]
    role_users.hset(KEYS.stats, "taken", 3)
    assert coordinator_stats(load_settings(broker_url=f"redis://127.0.0.1:{port}/0")) == {"taken": 3.0}
    producer = load_settings(
        broker_url=f"redis://{user('producer')}:{PASSWORDS['producer']}@127.0.0.1:{port}/0"
    )
    assert coordinator_stats(producer) is None


def test_every_role_may_wait_for_replicas_and_the_producer_may_fence(role_users: redis.Redis) -> None:
    """``CARPOOL_WAIT_REPLICAS`` needs WAIT on every role's connection, and the producer's fence."""
    from carpool.redis_edge.replication import FENCE_CHANNEL

    port = role_users.connection_pool.connection_kwargs["port"]
    for role in acl.ROLES:
        client = redis.Redis(port=port, username=user(role), password=PASSWORDS[role])
        assert client.wait(0, 10) == 0  # no replicas here: none acknowledge
        if role == "producer":
            assert client.publish(FENCE_CHANNEL, b"") == 0
        client.close()


def test_status_with_a_wrong_password_names_the_setting_to_change(role_users: redis.Redis) -> None:
    from tests.integration.test_observability import status_command

    server_port = role_users.connection_pool.connection_kwargs["port"]

    def status(credentials: str) -> subprocess.CompletedProcess[str]:
        env = {
            "CARPOOL_BROKER_URL": f"redis://{credentials}127.0.0.1:{server_port}/0",
            "PATH": "/usr/bin:/bin",
        }
        return subprocess.run(
            [*status_command(), "--once"], env=env, capture_output=True, text=True, timeout=60
        )

    wrong = status(f"{user('flower')}:not-its-password@")
    role_users.config_set("requirepass", "admin-only")  # the default user now needs a password
    try:
        missing = status("")
    finally:
        role_users.config_set("requirepass", "")
    for done in (wrong, missing):
        assert done.returncode == 2, done
        assert "Redis refused the credentials" in done.stderr and "CARPOOL_BROKER_URL" in done.stderr
        assert "not-its-password" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    # A role's user, or a database the server lacks: settings to change too (exit 2), not an outage
    # (found by the docs review: both said "redis unavailable", exit 1).
    as_producer = status(f"{user('producer')}:{PASSWORDS['producer']}@")
    assert as_producer.returncode == 2, as_producer
    assert "run it as the default user" in as_producer.stderr and "Traceback" not in as_producer.stderr
    env = {"CARPOOL_BROKER_URL": f"redis://127.0.0.1:{server_port}/99", "PATH": "/usr/bin:/bin"}
    no_db = subprocess.run([*status_command(), "--once"], env=env, capture_output=True, text=True, timeout=60)
    assert no_db.returncode == 2, no_db
    assert "no such database" in no_db.stderr and "CARPOOL_BROKER_URL" in no_db.stderr

"""Checks the compose stack started with docker-compose.acl.yml: every service on its own Redis user.

Run by .ci/compose-stack.sh after scripts/compose_check.py, once `up --wait` with the override has
returned (Redis loaded the aclfile the one-shot service wrote, and every service is healthy on its
role user). Reads the environment compose_check.py reads plus REDIS_<ROLE>_PASSWORD, and talks to
the published ports: Redis as its default user (to look) and as the producer (to produce and to be
refused), Flower and the metrics endpoint over HTTP. Each check prints one line; the first failure
ends the run (exit 1).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import redis
from compose_check import COMPOSE, ROOT, CheckFailed, Results, Stack, http_get, step, submit, wait_for
from redis.backoff import NoBackoff
from redis.exceptions import NoPermissionError
from redis.retry import Retry

ACL_FILE = "docker-compose.acl.yml"
ROLES = ("producer", "coordinator", "worker", "flower")
PREFIX = "carpool-"
# The service each long-running container's connections must come from, and as which user.
SERVICE_USERS = {"coordinator": "coordinator", "worker-cpu": "worker", "flower": "flower"}
DEMO_REQUESTS = 30
HOST_REQUESTS = 20
EMBEDDING_DIM = 384  # all-MiniLM-L6-v2
# What `carpool demo --external` asks and a producer's user may not answer (it goes without them):
# the coordinator's stats hash and the live-worker count, a script over the heartbeats.
DEMO_REFUSED = {"hgetall", "evalsha"}


def role_user(role: str) -> str:
    return PREFIX + role


def password(role: str) -> str:
    return os.environ[f"REDIS_{role.upper()}_PASSWORD"]


def role_url(stack: Stack, role: str, db: int) -> str:
    return f"redis://{role_user(role)}:{password(role)}@127.0.0.1:{stack.redis_port}/{db}"


def denials(admin: redis.Redis) -> list[dict[str, Any]]:
    """Redis's ACL log, less redis-py's CLIENT SETINFO on connect: it ignores the refusal, and the
    rules cannot grant that subcommand while they must load on Redis 7.0, which lacks it."""
    entries = admin.acl_log(128)
    return [e for e in entries if str(e.get("object", "")).lower() != "client|setinfo"]


def check_passwords_required() -> None:
    with step(f"compose refuses {ACL_FILE} while a role's password is unset"):
        env = {k: v for k, v in os.environ.items() if k != "REDIS_WORKER_PASSWORD"}
        out = subprocess.run(
            [*COMPOSE, "-f", ACL_FILE, "config", "--quiet"], capture_output=True, text=True, env=env, cwd=ROOT
        )
        if out.returncode == 0 or "REDIS_WORKER_PASSWORD" not in out.stderr:
            raise CheckFailed(f"config without REDIS_WORKER_PASSWORD: exit {out.returncode}, {out.stderr!r}")


def check_users(stack: Stack, admin: redis.Redis) -> None:
    with step("Redis loaded the aclfile: the default user keeps REDIS_PASSWORD, each role logs in"):
        try:
            # No retries: redis-py counts a refused login as a connection error and backs off.
            redis.Redis(port=stack.redis_port, retry=Retry(NoBackoff(), 0)).ping()
        except redis.AuthenticationError:  # the aclfile's default user has a password
            pass
        except redis.ResponseError as exc:  # NOAUTH, from servers that see no AUTH at all
            if "NOAUTH" not in str(exc):
                raise
        else:
            raise CheckFailed("Redis answered PING without a password")
        users = {str(u) for u in admin.acl_users()}
        if not {role_user(r) for r in ROLES} <= users:
            raise CheckFailed(f"Redis has the users {sorted(users)}")
        for role in ROLES:
            client = redis.Redis.from_url(role_url(stack, role, 0))
            client.ping()
            client.close()

    with step("Redis refused nothing to any service while they started"):
        if denials(admin):
            raise CheckFailed(f"Redis refused: {denials(admin)}")

    with step("every service is connected on its own user, none on the default one"):
        addresses = {
            stack.inspect(service, "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}"): service
            for service in SERVICE_USERS
        }
        seen: dict[str, set[str]] = {service: set() for service in SERVICE_USERS}
        mine = admin.client_id()
        for client in admin.client_list():
            ip = str(client["addr"]).rsplit(":", 1)[0]
            service = addresses.get(ip)
            if service is not None:
                seen[service].add(str(client["user"]))
            elif client["user"] == "default" and ip != "127.0.0.1" and int(client["id"]) != mine:
                # 127.0.0.1 inside the Redis container: its own healthcheck, the one default-user client.
                raise CheckFailed(f"a client on the default user: {client}")
        expected = {service: {role_user(role)} for service, role in SERVICE_USERS.items()}
        if seen != expected:
            raise CheckFailed(f"users per service {seen}, expected {expected}")
        print(f"compose-check:    {seen}", flush=True)


def check_demo_as_producer(stack: Stack, admin: redis.Redis) -> None:
    with step(f"the demo service on {role_user('producer')} (`carpool demo --external`) exits 0"):
        demo = subprocess.Popen(
            [
                *stack.compose,
                *("--profile", "demo", "run", "--rm", "-T", "--no-deps", "demo"),
                *("carpool", "demo", "--external", "--requests", str(DEMO_REQUESTS)),
            ],
            cwd=ROOT,
        )
        producer_seen = False
        while demo.poll() is None:
            users = {str(c["user"]) for c in admin.client_list()}
            producer_seen = producer_seen or role_user("producer") in users
            time.sleep(0.5)
        if demo.returncode != 0:
            raise CheckFailed(f"the demo exited {demo.returncode}")
        if not producer_seen:
            raise CheckFailed(f"no connection on {role_user('producer')} while the demo ran")


def check_host_producer(stack: Stack) -> dict[str, str]:
    with step(f"{HOST_REQUESTS} requests from the host on {role_user('producer')}, read back by id"):
        results = Results(role_url(stack, "producer", 1))  # MGET of the results it names
        sent = submit([f"request {i} from a producer on its own Redis user" for i in range(HOST_REQUESTS)])
        for task_id, meta in results.wait_all(list(sent), 120).items():
            if meta.get("status") != "SUCCESS" or len(meta.get("result") or ()) != EMBEDDING_DIM:
                raise CheckFailed(f"request {task_id}: {meta.get('status')} {str(meta.get('result'))[:200]}")
    return sent


def check_flower_and_metrics(stack: Stack, sent: dict[str, str]) -> None:
    with step(f"Flower on {role_user('flower')} lists them as SUCCESS and inspects the worker"):

        def listed() -> bool:
            tasks = stack.flower_tasks()
            return all(tasks.get(i, {}).get("state") == "SUCCESS" for i in sent)

        wait_for("Flower to list the host's requests", listed, 60)
        base = f"http://127.0.0.1:{stack.flower_port}"

        def inspected() -> bool:
            status, body = http_get(base + "/api/workers?refresh=1", stack.flower_auth)
            return status == 200 and b"carpool-gpu-" in body

        wait_for("Flower to inspect the worker", inspected, 60, every_s=2)

    with step(f"the coordinator on {role_user('coordinator')}: metrics count the requests and the worker"):
        status, body = http_get(f"http://127.0.0.1:{stack.metrics_port}/metrics")
        values = {
            line.split()[0]: float(line.split()[1])
            for line in body.decode().splitlines()
            if line.startswith(("carpool_requests_total ", "carpool_workers "))
        }
        least = DEMO_REQUESTS + 1 + HOST_REQUESTS  # the demo sends a warm-up request too
        if (
            status != 200
            or values.get("carpool_requests_total", 0) < least
            or values.get("carpool_workers") != 1
        ):
            raise CheckFailed(f"/metrics answered {status}: {values}, expected >= {least} requests, 1 worker")
        print(f"compose-check:    {values}", flush=True)


def check_producer_refused(stack: Stack, admin: redis.Redis) -> None:
    from carpool.redis_edge.keys import Keys

    with step("Redis refused the services nothing while they served, the producer only the demo's stats"):
        unexpected = [
            e
            for e in denials(admin)
            if e.get("username") != role_user("producer") or e.get("object") not in DEMO_REFUSED
        ]
        if unexpected:
            raise CheckFailed(f"Redis refused: {unexpected}")
        admin.acl_log_reset()

    with step(f"{role_user('producer')} cannot read in-flight state, delete queues or reach others' results"):
        keys = Keys("carpool.requests")
        broker = redis.Redis.from_url(role_url(stack, "producer", 0))
        results = redis.Redis.from_url(role_url(stack, "producer", 1))
        refused: dict[str, Callable[[], object]] = {
            "read in-flight state": lambda: broker.hgetall(keys.inflight_raw),
            "read the lease set": lambda: broker.zrange(keys.inflight_lease, 0, -1),
            "read the coordinator's stats": lambda: broker.hgetall(keys.stats),
            "take a request": lambda: broker.rpop("carpool.requests"),
            "delete the request queue": lambda: broker.delete("carpool.requests"),
            "delete the batch queue": lambda: broker.delete("carpool.batches"),
            "list results (KEYS)": lambda: results.keys("celery-task-meta-*"),
            "list results (SCAN)": lambda: results.scan(0, match="celery-task-meta-*"),
            "overwrite a result": lambda: results.set("celery-task-meta-forged", b"forged"),
            "flush the results": lambda: results.flushdb(),
        }
        for what, call in refused.items():
            try:
                call()
            except NoPermissionError:
                continue
            raise CheckFailed(f"the producer's user could {what}")
        logged = {str(e.get("username")) for e in denials(admin)}
        if logged != {role_user("producer")}:
            raise CheckFailed(f"ACL LOG names {logged} after the producer's refusals")
        broker.close()
        results.close()


def main() -> int:
    env = os.environ
    stack = Stack(
        compose=[*COMPOSE, "-f", ACL_FILE, "--profile", "cpu"],
        redis_port=int(env["REDIS_PORT"]),
        metrics_port=int(env["METRICS_PORT"]),
        flower_port=int(env["FLOWER_PORT"]),
        redis_password=env["REDIS_PASSWORD"],
        flower_auth=(env["FLOWER_USER"], env["FLOWER_PASSWORD"]),
    )
    # This process produces as the producer's user, as an application would.
    os.environ["CARPOOL_BROKER_URL"] = role_url(stack, "producer", 0)
    os.environ["CARPOOL_RESULT_BACKEND"] = role_url(stack, "producer", 1)
    admin = redis.Redis.from_url(stack.redis_url(0))
    started = time.monotonic()
    try:
        check_passwords_required()
        check_users(stack, admin)
        check_demo_as_producer(stack, admin)
        sent = check_host_producer(stack)
        check_flower_and_metrics(stack, sent)
        check_producer_refused(stack, admin)
    except (CheckFailed, subprocess.CalledProcessError, redis.RedisError) as exc:
        print(f"compose-check: FAILED: {exc!r}", file=sys.stderr, flush=True)
        return 1
    print(f"compose-check: every role-user check passed in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

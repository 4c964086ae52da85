"""ACL rule generation (carpool acl): what each role may touch, judged as Redis 7 would judge it."""

from __future__ import annotations

import hashlib
import re

import pytest

from carpool.config import Settings, load_settings
from carpool.errors import ConfigError
from carpool.redis_edge.keys import Keys
from carpool.tools import acl
from carpool.tools.acl import Grant, RoleAcl

ENV = {
    "REDIS_PASSWORD": "admin-pw",
    "REDIS_PRODUCER_PASSWORD": "p-pw",
    "REDIS_COORDINATOR_PASSWORD": "c-pw",
    "REDIS_WORKER_PASSWORD": "w-pw",
    "REDIS_FLOWER_PASSWORD": "f-pw",
}
RESULT = "celery-task-meta-5f0c3b36-0c4e-4a47-9b1e-2e8f6d1c9a10"
# How a command touches its keys, as far as these tests need it (Redis's key specs).
READS = {
    "get",
    "mget",
    "llen",
    "smembers",
    "exists",
    "hgetall",
    "hget",
    "hmget",
    "zscore",
    "zmscore",
    "zcard",
    "zrange",
    "zrangebyscore",
}


def settings(**overrides: object) -> Settings:
    urls = {"broker_url": "redis://127.0.0.1:6379/0", "result_backend": "redis://127.0.0.1:6379/1"}
    return load_settings(**{**urls, **overrides})


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A Redis glob (``*``, ``?``, ``[...]``, backslash escapes) as a regex."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            out.append(re.escape(pattern[i + 1]))
            i += 2
            continue
        out.append({"*": ".*", "?": "."}.get(c, re.escape(c)))
        i += 1
    return re.compile("".join(out), re.DOTALL)


def key_allowed(grant: Grant, key: str, access: str) -> bool:
    for spec in grant.keys:
        flags, _, pattern = spec.partition("~")
        granted = {"": "RW", "%R": "R", "%W": "W", "%RW": "RW"}[flags]
        if all(a in granted for a in access) and glob_regex(pattern).fullmatch(key):
            return True
    return False


def allowed(role: RoleAcl, command: str, keys: tuple[str, ...] = (), channels: tuple[str, ...] = ()) -> bool:
    """Whether one grant (root or selector) allows ``command`` on all of ``keys`` and ``channels``."""
    access = "R" if command in READS else ("RW" if command == "evalsha" else "W")
    return any(
        command in g.commands
        and all(key_allowed(g, k, access) for k in keys)
        and all(any(glob_regex(p).fullmatch(ch) for p in g.channels) for ch in channels)
        for g in role.grants
    )


@pytest.fixture()
def roles() -> dict[acl.Role, RoleAcl]:
    return acl.role_acls(settings())


def test_producer_pushes_requests_and_reads_named_results_only(roles: dict[acl.Role, RoleAcl]) -> None:
    producer = roles["producer"]
    for key in Keys("carpool.requests").request_lists:
        assert allowed(producer, "lpush", (key,))
    assert allowed(producer, "get", (RESULT,))
    assert allowed(producer, "mget", (RESULT, RESULT))
    assert allowed(producer, "subscribe", channels=(RESULT,))
    assert allowed(producer, "publish", channels=("/0.celeryev/task.sent",))
    assert allowed(producer, "publish", channels=("/0.celeryev/task.multi",))


def test_producer_cannot_read_state_delete_list_or_overwrite(roles: dict[acl.Role, RoleAcl]) -> None:
    producer = roles["producer"]
    keys = Keys("carpool.requests")
    for key in (keys.inflight_raw, keys.inflight_lease, keys.inflight_owner, keys.dead_letter, keys.stats):
        for command in ("get", "hgetall", "hget", "llen", "lpush", "zscore"):
            assert not allowed(producer, command, (key,)), (command, key)
    for command in ("del", "unlink", "keys", "scan", "flushdb", "flushall", "set", "rename", "lrange"):
        assert not allowed(producer, command, (RESULT,)), command
        assert not allowed(producer, command, ("carpool.requests",)), command
    assert not allowed(producer, "lpush", (RESULT,))  # a list under a result key would block the answer
    assert not allowed(producer, "sadd", ("carpool.requests",))  # nor a set under the request list
    assert not allowed(producer, "publish", channels=(RESULT,))  # no forged results
    assert not allowed(producer, "psubscribe", channels=("celery-task-meta-*",))
    assert not allowed(producer, "subscribe", channels=("/0.celeryev/task.multi",))  # others' texts
    assert not allowed(producer, "lpush", ("carpool.batches",))
    assert not allowed(producer, "evalsha", ("carpool.requests",))


def test_result_inboxes_are_result_channels(roles: dict[acl.Role, RoleAcl]) -> None:
    """A producer listens on its result inbox; whoever stores results publishes there."""
    from carpool.celery_edge.app import app
    from carpool.names import INBOX_CHANNEL

    inbox = acl.RESULT_KEY_PREFIX + INBOX_CHANNEL + "3f9a0c1b2d4e5f60718293a4"
    assert app.backend.inbox_prefix == (acl.RESULT_KEY_PREFIX + INBOX_CHANNEL).encode()
    assert allowed(roles["producer"], "subscribe", channels=(inbox,))
    assert allowed(roles["producer"], "unsubscribe")
    assert not allowed(roles["producer"], "publish", channels=(inbox,))  # no forged results
    for role in ("coordinator", "worker"):
        assert allowed(roles[role], "publish", channels=(inbox,)), role


def test_every_script_finds_all_its_keys_in_one_grant(roles: dict[acl.Role, RoleAcl]) -> None:
    keys = Keys("carpool.requests")
    reports = keys.reports_for("carpool-coordinator-1@host")
    take = (keys.inflight_lease, keys.inflight_raw, reports, keys.inflight_origin, *keys.request_lists)
    dispatch = (keys.inflight_lease, keys.inflight_owner, "carpool.batches")
    requeue = (*keys.inflight, *keys.request_lists)
    stats = (keys.stats, keys.stats_applied_of("carpool-coordinator-1@host:5f0c2a9e41d3"))
    for script_keys in (take, dispatch, requeue, (keys.workers,), (RESULT, RESULT), stats):
        assert allowed(roles["coordinator"], "evalsha", script_keys), script_keys
    claim_fresh = (keys.inflight_lease, keys.inflight_owner, RESULT, "carpool.batches")
    finish = (*keys.inflight, reports, RESULT)
    kombu = ("_kombu.binding.celery.pidbox", "_kombu.binding_deadlines")
    heartbeat = (keys.workers, keys.worker_queues)
    for script_keys in (claim_fresh, finish, heartbeat, kombu):
        assert allowed(roles["worker"], "evalsha", script_keys), script_keys
    assert allowed(roles["flower"], "evalsha", ("_kombu.binding.celeryev", "_kombu.binding_deadlines"))


def test_commands_inside_the_scripts_are_allowed_key_by_key(roles: dict[acl.Role, RoleAcl]) -> None:
    keys = Keys("carpool.requests")
    coordinator, worker = roles["coordinator"], roles["worker"]
    for key in keys.request_lists:
        assert allowed(coordinator, "rpop", (key,))
    assert allowed(coordinator, "rpush", ("carpool.requests",))
    assert allowed(coordinator, "lpush", ("carpool.batches",))
    assert allowed(coordinator, "set", (RESULT,))
    assert allowed(coordinator, "publish", channels=(RESULT,))
    assert allowed(coordinator, "publish", channels=("/0.celeryev/task.multi",))
    assert not allowed(coordinator, "lpush", (RESULT,))
    assert not allowed(coordinator, "del", (RESULT,))
    assert allowed(worker, "set", (RESULT,))
    assert allowed(worker, "exists", (RESULT,))
    assert allowed(worker, "select")
    assert allowed(worker, "hdel", (keys.inflight_raw,))
    # A worker's heartbeat names its batch queues (and drops those of the silent); coordinators read them.
    assert allowed(worker, "hset", (keys.worker_queues,))
    assert allowed(worker, "hdel", (keys.worker_queues,))
    assert allowed(worker, "zrangebyscore", (keys.workers,))
    assert allowed(coordinator, "zrange", (keys.workers,))
    assert allowed(coordinator, "hgetall", (keys.worker_queues,))
    assert not allowed(coordinator, "hset", (keys.worker_queues,))
    assert allowed(worker, "lpush", (keys.reports_for("c"),))
    assert allowed(worker, "llen", ("carpool.batches",))
    assert not allowed(worker, "rpop", ("carpool.requests",))  # workers never take requests
    assert not allowed(worker, "hset", (keys.stats,))
    applied = keys.stats_applied_of("carpool-coordinator-1@host:5f0c2a9e41d3")
    for command in ("hmget", "hset", "expire"):
        assert allowed(coordinator, command, (applied,)), command
    assert not allowed(worker, "hset", (applied,))


def test_coordinator_writes_its_expiring_gauges_and_only_those(roles: dict[acl.Role, RoleAcl]) -> None:
    keys = Keys("carpool.requests")
    coordinator, worker = roles["coordinator"], roles["worker"]
    gauges = keys.gauges_of("carpool-coordinator-7@host")
    assert allowed(coordinator, "hincrby", (keys.stats,))
    for command in ("hset", "expire", "del"):
        assert allowed(coordinator, command, (gauges,))
    for command in ("zadd", "zrem", "zremrangebyscore"):
        assert allowed(coordinator, command, (keys.coordinators,))
    assert not allowed(coordinator, "expire", ("carpool.requests",))  # nothing else gets an expiry
    assert not allowed(coordinator, "expire", (keys.inflight_raw,))
    assert not allowed(worker, "hset", (gauges,))
    assert not allowed(roles["producer"], "hgetall", (gauges,))


def test_coordinators_record_revokes_that_workers_only_read(roles: dict[acl.Role, RoleAcl]) -> None:
    revoked = Keys("carpool.requests").revoked
    for command in ("zadd", "zremrangebyscore", "zremrangebyrank", "zrangebyscore"):
        assert allowed(roles["coordinator"], command, (revoked,))
    assert allowed(roles["worker"], "zrangebyscore", (revoked,))
    for command in ("zadd", "zrem", "zremrangebyscore", "del"):  # a worker could un-revoke a request
        assert not allowed(roles["worker"], command, (revoked,))
    assert not allowed(roles["producer"], "zrangebyscore", (revoked,))
    # Celery's revoke handler marks the task REVOKED in every worker that hears it, after reading
    # its meta (a success stays).
    for command in ("get", "setex"):
        assert allowed(roles["worker"], command, (RESULT,))


def test_worker_is_a_celery_consumer_and_flower_reads(roles: dict[acl.Role, RoleAcl]) -> None:
    worker, flower = roles["worker"], roles["flower"]
    batches = acl.priority_lists("carpool.batches")
    assert allowed(worker, "brpop", tuple(batches))
    for command in ("lindex", "rpop", "rpush"):  # its claim takes the next batch message, or gives it back
        assert allowed(worker, command, ("carpool.batches",))
    assert not allowed(worker, "rpop", ("carpool.requests",))
    assert not allowed(worker, "rpush", ("carpool.requests",))
    assert allowed(worker, "psubscribe", channels=("/0.celery.pidbox",))
    assert allowed(worker, "publish", channels=("/0.celeryev/worker.heartbeat",))
    assert allowed(worker, "lpush", ("0b1c.reply.celery.pidbox",))
    assert allowed(flower, "psubscribe", channels=("/0.celeryev/*",))
    assert allowed(flower, "publish", channels=("/0.celery.pidbox",))
    assert allowed(flower, "brpop", ("0b1c.reply.celery.pidbox", "0b1c.reply.celery.pidbox\x06\x163"))
    assert allowed(flower, "llen", tuple(batches))
    assert allowed(flower, "get", (RESULT,))
    assert not allowed(flower, "brpop", ("carpool.batches",))
    assert not allowed(flower, "set", (RESULT,))
    assert not allowed(flower, "hgetall", (Keys("carpool.requests").inflight_raw,))


def test_every_role_that_waits_on_replicas_may_publish_its_fence(roles: dict[acl.Role, RoleAcl]) -> None:
    """The coordinator fences its takes, a worker its results on another server (CARPOOL_WAIT_REPLICAS)."""
    from carpool.redis_edge.replication import FENCE_CHANNEL

    for role in ("producer", "coordinator", "worker"):
        assert allowed(roles[role], "publish", channels=(FENCE_CHANNEL,)), role
    assert not allowed(roles["flower"], "publish", channels=(FENCE_CHANNEL,))


def test_a_worker_counts_refused_writes_and_a_coordinator_reads_back_a_refused_one(
    roles: dict[acl.Role, RoleAcl],
) -> None:
    stats = Keys("carpool.requests").stats
    assert allowed(roles["worker"], "hincrby", (stats,))
    assert not allowed(roles["worker"], "hdel", (stats,))
    assert allowed(roles["coordinator"], "get", (RESULT,))  # finish.lua, when a write is refused


def test_the_batch_queues_of_batched_tasks_are_in_the_rules() -> None:
    """@batched(batch_queue=...) tasks in CARPOOL_IMPORTS: their coordinators push there, their
    workers consume there."""
    roles = acl.role_acls(settings(imports=("tests.integration.batched_tasks",)))
    own = acl.priority_lists("carpool.batches.pairs")
    assert allowed(roles["coordinator"], "lpush", ("carpool.batches.pairs",))
    assert allowed(roles["coordinator"], "evalsha", ("carpool.batches.pairs",))
    assert allowed(roles["worker"], "brpop", tuple(own))
    assert allowed(roles["worker"], "sadd", ("_kombu.binding.carpool.batches.pairs",))
    assert allowed(roles["flower"], "llen", tuple(own))
    assert not allowed(roles["producer"], "lpush", ("carpool.batches.pairs",))


def test_names_follow_the_settings() -> None:
    roles = acl.role_acls(
        settings(
            request_queue="team[a].req*",
            batch_queue="team-a.batches",
            broker_url="redis://h:6379/3",
            result_backend="redis://h:6379/4",
        )
    )
    producer = roles["producer"]
    assert allowed(producer, "lpush", ("team[a].req*",))
    assert allowed(producer, "lpush", ("team[a].req*\x06\x169",))
    assert not allowed(producer, "lpush", ("teama.req*",))  # the brackets are literal
    assert not allowed(producer, "lpush", ("team[a].req*-other",))  # so is the star
    assert allowed(producer, "publish", channels=("/3.celeryev/task.sent",))
    assert not allowed(producer, "publish", channels=("/0.celeryev/task.sent",))
    assert allowed(roles["coordinator"], "hset", ("carpool:team[a].req*:stats",))
    assert allowed(roles["worker"], "brpop", ("team-a.batches",))


def test_glob_escape_matches_only_the_name() -> None:
    for name in ("plain", "a*b", "q?", "x[1]", "back\\slash"):
        pattern = glob_regex(acl.glob_escape(name))
        assert pattern.fullmatch(name)
        assert not pattern.fullmatch(name + "x")


def test_rules_put_the_first_grant_at_the_root_and_the_rest_in_selectors() -> None:
    role = RoleAcl(
        "producer",
        "test",
        (Grant("root", ("ping", "lpush"), ("~q",)), Grant("sel", ("get",), ("%R~r*",), ("r*",))),
    )
    assert role.rules() == ["+ping", "+lpush", "~q", "(+get %R~r* &r*)"]
    assert acl.user_rules(role, "pw")[:3] == ["reset", "on", "#" + hashlib.sha256(b"pw").hexdigest()]


def test_commands_format_quotes_what_redis_cli_must_unescape() -> None:
    text = acl.render(settings(), ["producer"], "commands", ENV)
    (line,) = text.splitlines()
    assert line.startswith("ACL SETUSER carpool-producer reset on #")
    assert '"~carpool.requests\\x06\\x163"' in line
    assert '"(+get +mget +subscribe %R~celery-task-meta-* &celery-task-meta-*)"' in line
    assert "p-pw" not in line  # only the hash


def test_aclfile_keeps_the_default_user_and_writes_names_raw() -> None:
    text = acl.render(settings(), list(acl.ROLES), "aclfile", ENV, prefix="cp-")
    lines = text.splitlines()
    assert lines[0] == f"user default on #{hashlib.sha256(b'admin-pw').hexdigest()} ~* &* +@all"
    assert [line.split()[1] for line in lines[1:]] == [f"cp-{r}" for r in acl.ROLES]
    assert "~carpool.requests\x06\x163" in lines[1]
    assert '"' not in text  # the aclfile parser has no quoting


def test_explain_needs_no_password_and_says_why() -> None:
    text = acl.render(settings(), ["producer"], "explain", {})
    assert text.startswith("producer: ")
    assert "  read and await a result by its task id, or this process's result inbox:\n" in text
    assert "#" not in text


def test_aclfile_needs_the_default_password() -> None:
    env = {k: v for k, v in ENV.items() if k != "REDIS_PASSWORD"}
    with pytest.raises(ConfigError, match="REDIS_PASSWORD"):
        acl.render(settings(), ["producer"], "aclfile", env)
    assert acl.render(settings(), ["producer"], "commands", env)


def test_aclfile_refuses_whitespace_in_names() -> None:
    with pytest.raises(ConfigError, match="whitespace"):
        acl.render(settings(request_queue="my queue"), ["producer"], "aclfile", ENV)


def test_passwords_come_from_the_environment() -> None:
    env = {"REDIS_PASSWORD": "x", "MINE": "m"}
    with pytest.raises(ConfigError, match="REDIS_PRODUCER_PASSWORD"):
        acl.render(settings(), ["producer"], "commands", env)
    text = acl.render(settings(), ["producer"], "commands", env, ["MINE"])
    assert hashlib.sha256(b"m").hexdigest() in text
    text = acl.render(
        settings(), ["producer", "flower"], "commands", {**env, "F": "f"}, ["producer=MINE", "flower=F"]
    )
    assert hashlib.sha256(b"f").hexdigest() in text
    with pytest.raises(ConfigError, match="several roles"):
        acl.render(settings(), ["producer", "flower"], "commands", env, ["MINE"])
    with pytest.raises(ConfigError, match="not one of the chosen roles"):
        acl.render(settings(), ["producer"], "commands", env, ["worker=MINE"])


def test_cli_prints_the_chosen_roles(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from carpool.cli import main

    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    assert main(["acl", "--role", "worker", "--role", "flower"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in out] == ["carpool-worker", "carpool-flower"]
    monkeypatch.delenv("REDIS_WORKER_PASSWORD")
    assert main(["acl", "--role", "worker"]) == 2
    assert "REDIS_WORKER_PASSWORD" in capsys.readouterr().err


def test_celery_and_kombu_names_are_the_installed_ones() -> None:
    from celery.backends.base import KeyValueStoreBackend
    from kombu.transport.redis import Channel

    from carpool.celery_edge.app import create_app

    app = create_app(settings())
    assert KeyValueStoreBackend.task_keyprefix == acl.RESULT_KEY_PREFIX
    assert app.conf.event_exchange == acl.EVENT_EXCHANGE
    assert app.control.mailbox.exchange.name == acl.PIDBOX_EXCHANGE
    assert app.control.mailbox.reply_exchange.name == acl.REPLY_EXCHANGE
    assert Channel.keyprefix_queue == acl.BINDING_TABLE
    assert Channel.keyprefix_binding_permanent == acl.BINDING_PERMANENT
    assert Channel.keyprefix_binding_deadlines.startswith(acl.BINDING_PREFIX)
    assert Channel.keyprefix_fanout == acl.FANOUT_PREFIX
    assert acl.priority_lists("q") == ["q", *(f"q{Channel.sep}{s}" for s in Channel.priority_steps if s)]


def test_a_refusal_under_a_users_rules_is_told_from_other_redis_errors() -> None:
    import redis

    from carpool.redis_edge.store import acl_refusal, refused_by_acl

    in_script = redis.ResponseError(
        "The user executing the script can't run this command or subcommand script: 51d5ed59, "
        "on @user_script:48."
    )
    assert refused_by_acl(in_script)
    assert refused_by_acl(  # Redis 7.2 on
        redis.ResponseError(
            "ACL failure in script: User carpool-worker has no permissions to run the 'hsetnx' command "
            "script: 51d5ed59, on @user_script:48."
        )
    )
    assert refused_by_acl(
        redis.exceptions.NoPermissionError("User u has no permissions to run the 'hsetnx' command")
    )
    assert not refused_by_acl(
        redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")
    )
    assert not refused_by_acl(redis.ConnectionError("Connection refused"))
    client = redis.Redis(username="carpool-worker", password="pw")  # never connects
    error = acl_refusal("worker", client, in_script)
    assert isinstance(error, ConfigError)
    assert "'carpool-worker'" in str(error) and "carpool acl --role worker" in str(error)
    assert "can't run this command" in str(error)  # Redis's own words, kept

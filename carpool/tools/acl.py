"""``carpool acl``: one Redis user per role, allowed only the commands, keys and channels that role uses.

Settings (queue names, broker db) in, ACL rules per role out, printed as ``ACL SETUSER`` commands for
``redis-cli`` or as an aclfile for ``redis-server --aclfile``. The default user keeps
``REDIS_PASSWORD`` and every permission; the role users come in addition.

Each role's rules are a list of grants: the first is the user's root permissions, each further one a
Redis 7 selector, so that a command granted for one set of keys cannot touch another's (a producer
may LPUSH to the request lists and GET results, but neither LPUSH onto a result key nor GET a list).
Naming a result's task id is the capability to read it: no role but the workers and coordinators
can write results, and none can list, scan or delete them.

Requires Redis 7.0 or later (selectors, read-only key patterns).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from carpool.config import Settings
from carpool.errors import ConfigError
from carpool.redis_edge.keys import PRIORITY_SEP, PRIORITY_STEPS, Keys
from carpool.redis_edge.replication import FENCE_CHANNEL

Role = Literal["producer", "coordinator", "worker", "flower"]
ROLES: tuple[Role, ...] = get_args(Role)
Format = Literal["commands", "aclfile", "explain"]

# Names of Celery's and kombu's own Redis keys and channels (tests/unit/test_acl.py checks each
# against the installed versions).
# KeyValueStoreBackend.task_keyprefix; the result channel too, and the start of every result inbox
# channel (carpool.celery_edge.inbox), so the result channel grants cover the inboxes.
RESULT_KEY_PREFIX = "celery-task-meta-"
EVENT_EXCHANGE = "celeryev"  # Celery's event_exchange
PIDBOX_EXCHANGE = "celery.pidbox"  # "<control_exchange>.pidbox": broadcast to workers
REPLY_EXCHANGE = "reply.celery.pidbox"  # "reply.<control_exchange>.pidbox": replies to the asker
BINDING_TABLE = "_kombu.binding.%s"  # kombu Channel.keyprefix_queue
BINDING_PERMANENT = "_kombu.binding_permanent.%s"  # kombu Channel.keyprefix_binding_permanent
BINDING_PREFIX = "_kombu.binding"  # every binding table, their permanent sets and deadlines ZSET
FANOUT_PREFIX = "/{db}."  # kombu Channel.keyprefix_fanout: PUB/SUB is global, so topics carry the db


def _commands(names: str) -> tuple[str, ...]:
    return tuple(names.split())


# Commands any role needs on its connections: results live in another database than the broker;
# WAIT is how each role makes its writes durable on replicas (CARPOOL_WAIT_REPLICAS).
_CONNECTION = _commands("ping select multi exec wait")
# redis-py's Script: EVALSHA, loading the script on NOSCRIPT (SCRIPT EXISTS first inside pipelines).
# Redis checks EVALSHA against the keys the script declares, all in one grant, and then each command the
# script runs on its own, so a script grant holds every key its scripts name and nothing else.
_SCRIPTS = _commands("evalsha script|load script|exists")
# kombu's consumer bookkeeping: its binding tables, refreshed and swept by scripts.
_KOMBU_BINDINGS = _commands("sadd srem smembers exists del zadd zrem zrangebyscore time")

DEFAULT_USER_PREFIX = "carpool-"
DEFAULT_PASSWORD_ENV = "REDIS_PASSWORD"


@dataclass(frozen=True, slots=True)
class Grant:
    """Commands and the keys and channels they may touch.

    ``keys`` are Redis key patterns with their access: ``~p`` read and write, ``%R~p`` read only,
    ``%W~p`` write only. ``channels`` are PUB/SUB channel patterns (without the ``&``).
    """

    why: str
    commands: tuple[str, ...]
    keys: tuple[str, ...] = ()
    channels: tuple[str, ...] = ()

    def rules(self) -> list[str]:
        return [*(f"+{c}" for c in self.commands), *self.keys, *(f"&{c}" for c in self.channels)]


@dataclass(frozen=True, slots=True)
class RoleAcl:
    """The grants of one role: the first is the user's root permissions, the rest selectors."""

    role: Role
    summary: str
    grants: tuple[Grant, ...]

    def rules(self) -> list[str]:
        """ACL rules after the user's name and password, as ``ACL SETUSER`` takes them."""
        root, *selectors = self.grants
        return [*root.rules(), *("(" + " ".join(s.rules()) + ")" for s in selectors)]


def glob_escape(name: str) -> str:
    """``name`` as a Redis glob pattern that matches only itself."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in name)


def priority_lists(queue: str) -> list[str]:
    """Every list kombu's Redis transport uses for ``queue``: the queue, then one per priority step."""
    return [queue, *(f"{queue}{PRIORITY_SEP}{step}" for step in PRIORITY_STEPS if step)]


def _exact(names: Sequence[str], access: str = "~") -> tuple[str, ...]:
    return tuple(access + glob_escape(n) for n in names)


def _broker_db(settings: Settings) -> int:
    from carpool.redis_edge.connect import server_and_db

    return server_and_db(settings.broker_url)[1]


def batch_queue_names(settings: Settings) -> list[str]:
    """Every batch queue of the deployment: ``CARPOOL_BATCH_QUEUE`` and the own queue of each
    ``@batched(batch_queue=...)`` task in ``CARPOOL_IMPORTS`` (its coordinators push there, the
    workers that serve it consume it)."""
    from carpool.registry import import_task_modules, registered

    import_task_modules(settings.imports)
    queues = [settings.batch_queue]
    for spec in registered().values():
        if spec.batch_queue and spec.batch_queue not in queues:
            queues.append(spec.batch_queue)
    return queues


def role_acls(settings: Settings) -> dict[Role, RoleAcl]:
    """The rules of every role for the deployment ``settings`` describe."""
    keys = Keys(settings.request_queue)
    requests = priority_lists(settings.request_queue)
    batch_queues = batch_queue_names(settings)
    batches = [name for queue in batch_queues for name in priority_lists(queue)]
    batch_bindings = [table % queue for queue in batch_queues for table in (BINDING_TABLE, BINDING_PERMANENT)]
    results = glob_escape(RESULT_KEY_PREFIX) + "*"
    reports = glob_escape(keys.reports_for("")) + "*"
    gauges = glob_escape(keys.gauges_of("")) + "*"
    applied = glob_escape(keys.stats_applied_of("")) + "*"
    inflight = [
        *keys.inflight,
        keys.inflight_deaths,
        keys.inflight_running,
        keys.links_due,
        keys.links_pending,
        keys.links_tries,
    ]
    fanout = FANOUT_PREFIX.format(db=_broker_db(settings))
    events = glob_escape(f"{fanout}{EVENT_EXCHANGE}/")
    pidbox = glob_escape(f"{fanout}{PIDBOX_EXCHANGE}")
    replies = (
        f"*{glob_escape('.' + REPLY_EXCHANGE)}",
        f"*{glob_escape('.' + REPLY_EXCHANGE + PRIORITY_SEP)}?",
    )
    # WAIT behind a write of its own, for what another connection (Celery's publish, the results'
    # server) wrote: every role that waits on replicas publishes on the fence channel.
    fence = Grant(
        "the replication fence, a write of its own to WAIT behind (CARPOOL_WAIT_REPLICAS)",
        ("publish",),
        channels=(glob_escape(FENCE_CHANNEL),),
    )
    consumer_bindings = Grant(
        "kombu's binding tables, which every Celery consumer declares, refreshes and sweeps",
        (*_KOMBU_BINDINGS, *_SCRIPTS),
        (f"~{glob_escape(BINDING_PREFIX)}*",),
    )

    # A chain's next step, a callback or an error callback on a carpool task is sent by the process
    # that answered the request (a worker, or a coordinator refusing it), through Celery's publish.
    send_requests = Grant(
        "send chains' next steps and callbacks to the request queue (Celery's publish path)",
        ("lpush", "llen", "sadd"),
        _exact(requests)
        + _exact([BINDING_TABLE % settings.request_queue, BINDING_PERMANENT % settings.request_queue]),
    )

    producer = RoleAcl(
        "producer",
        "sends requests (infer.delay, submit_many, send_task) and reads the results it names",
        (
            Grant(
                "push requests; LLEN is kombu's queue declaration",
                (*_CONNECTION, "lpush", "llen", "unsubscribe"),
                _exact(requests),
            ),
            Grant(
                "kombu's declaration of the request queue on Celery's own publish path",
                ("sadd",),
                _exact([BINDING_TABLE % settings.request_queue, BINDING_PERMANENT % settings.request_queue]),
            ),
            Grant(
                "task-sent events (Celery's, and carpool's batched ones); the replication fence, a"
                " write of its own to WAIT behind after Celery's publish",
                ("publish",),
                channels=(f"{events}task.sent", f"{events}task.multi", glob_escape(FENCE_CHANNEL)),
            ),
            Grant(
                "read and await a result by its task id, or this process's result inbox",
                ("get", "mget", "subscribe"),
                (f"%R~{results}",),
                (results,),
            ),
        ),
    )
    coordinator = RoleAcl(
        "coordinator",
        "drains the request lists into batches, keeps in-flight state, stores rejections",
        (
            Grant(
                "take requests into flight, requeue, dead-letter, read reports, write stats, record revokes",
                _CONNECTION
                + _commands("time rpop rpush lpush ltrim blmove hset hsetnx hget hmget hdel hincrby exists")
                + _commands("info")  # the server's checks at start: its version, its memory policy
                + _commands("zadd zrem zscore zmscore zcard zrangebyscore zremrangebyscore zremrangebyrank"),
                (
                    *_exact(requests),
                    *_exact([*inflight, keys.dead_letter, keys.workers, keys.stats, keys.revoked]),
                    f"~{reports}",
                ),
            ),
            Grant(
                "the in-flight scripts (take, dispatch, renew, requeue), the write-once result store and"
                " the stats",
                _SCRIPTS,
                (
                    *_exact(requests),
                    *_exact([*inflight, keys.workers, *batch_queues, keys.stats]),
                    f"~{reports}",
                    f"~{results}",
                    f"~{applied}",
                ),
            ),
            Grant(
                "keep the stats totals it added, so that a write sent again adds nothing twice",
                ("hmget", "hset", "expire", "del"),
                (f"~{applied}",),
            ),
            Grant("push batches to the workers' queues", ("lpush",), _exact(batch_queues)),
            Grant(
                "read which batch queues the live workers consume, to say when none consumes one",
                ("zrange", "hgetall"),
                _exact([keys.workers, keys.worker_queues], "%R~"),
            ),
            Grant(
                "write its gauges, which expire unless rewritten, and list itself as their writer; read"
                " what its peers serve, to say when they differ",
                ("hset", "hget", "expire", "del", "zadd", "zrange", "zrem", "zremrangebyscore"),
                (f"~{gauges}", *_exact([keys.coordinators])),
            ),
            Grant(
                "store a rejected request's error, write-once (a refused write is read back: a resent"
                " store answers as its first sending did), and wake its producer (its result inbox too)",
                ("set", "get", "publish"),
                (f"~{results}",),
                (results,),
            ),
            Grant(
                "task-received events, and task-sent ones for the error callbacks it sends",
                ("publish",),
                channels=(f"{events}task.multi", f"{events}task.sent"),
            ),
            send_requests,
            fence,
            Grant("hear revoke() broadcasts", ("subscribe", "unsubscribe"), channels=(pidbox,)),
        ),
    )
    worker = RoleAcl(
        "worker",
        "runs batches (a Celery worker on the batch queue) and stores each request's result",
        (
            Grant(
                "claim, renew and acknowledge requests, report to coordinators, heartbeat",
                _CONNECTION
                + _commands("time hset hsetnx hget hmget hkeys hdel lpush ltrim expire")
                + _commands("info")  # the server's checks at start: its version, its memory policy
                + _commands("zadd zrem zscore zmscore zcard zrangebyscore zremrangebyscore"),
                (*_exact([*inflight, keys.workers, keys.worker_queues]), f"~{reports}"),
            ),
            Grant(
                "count the results write-once refused (a rerun's), in the stats hash",
                ("hincrby",),
                _exact([keys.stats]),
            ),
            Grant(
                "read the revokes coordinators recorded, at start (never change them)",
                ("zrangebyscore",),
                _exact([keys.revoked], "%R~"),
            ),
            Grant(
                "the in-flight scripts (claim, finish, renew, heartbeat) and the write-once result store; "
                "claim counts the batches queued and takes the next",
                _SCRIPTS,
                (
                    *_exact([*inflight, keys.workers, keys.worker_queues, *batches]),
                    f"~{reports}",
                    f"~{results}",
                ),
            ),
            Grant(
                "store results write-once and wake their producers (their result inboxes too); see which"
                " are stored; mark a revoked task REVOKED as Celery's revoke handler does (it reads the"
                " task's meta first, to keep a success)",
                ("set", "setex", "get", "exists", "mget", "publish"),
                (f"~{results}",),
                (results,),
            ),
            Grant(
                "consume the batch queue (its claim script takes the next message with LINDEX and RPOP;"
                " one it cannot run now goes back with RPUSH)",
                ("brpop", "llen", "sadd", "lindex", "rpop", "rpush"),
                _exact(batches) + _exact(batch_bindings),
            ),
            Grant("worker and task events", ("publish",), channels=(f"{events}*",)),
            fence,
            Grant(
                "remote control: hear broadcasts, reply to the asker, its own mailbox queue",
                ("psubscribe", "punsubscribe", "lpush", "llen", "del"),
                (
                    f"~*{glob_escape('.' + PIDBOX_EXCHANGE)}",
                    f"~*{glob_escape('.' + PIDBOX_EXCHANGE + PRIORITY_SEP)}?",
                ),
                (pidbox,),
            ),
            consumer_bindings,
            send_requests,
        ),
    )
    flower = RoleAcl(
        "flower",
        "reads events, inspects workers (control commands too: guard them with Flower's own auth)",
        (
            Grant(
                "queue lengths, and its event receiver's queue, which kombu declares (LLEN)",
                (*_CONNECTION, "llen"),
                (
                    *_exact(requests, "%R~"),
                    *_exact(batches, "%R~"),
                    f"%R~{glob_escape(EVENT_EXCHANGE + '.')}*",
                ),
            ),
            Grant("events", ("psubscribe", "punsubscribe"), channels=(f"{events}*",)),
            Grant("broadcast inspect and control commands", ("publish",), channels=(pidbox,)),
            Grant("collect the replies", ("brpop", "llen", "del"), tuple(f"~{r}" for r in replies)),
            Grant(
                "a task's result (Flower's /api/task/result)",
                ("get", "subscribe", "unsubscribe"),
                (f"%R~{results}",),
                (results,),
            ),
            consumer_bindings,
        ),
    )
    return {acl.role: acl for acl in (producer, coordinator, worker, flower)}


def password_hash(password: str) -> str:
    """The ``#<sha256>`` rule Redis stores for ``password``: no plain text in a file or a command log."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def user_rules(acl: RoleAcl, password: str) -> list[str]:
    """The rules that make a user exactly ``acl``, whatever it held before (``reset`` first)."""
    return ["reset", "on", password_hash(password), *acl.rules()]


def _quote(arg: str) -> str:
    """``arg`` for redis-cli's line parser: double-quoted with escapes when it needs them."""
    if arg and all(c.isprintable() and not c.isspace() and c not in "\"'\\" for c in arg):
        return arg
    out = []
    for c in arg:
        if c in '"\\':
            out.append("\\" + c)
        elif c.isprintable() and c != "\n":
            out.append(c)
        else:
            out.extend(f"\\x{b:02x}" for b in c.encode())
    return '"' + "".join(out) + '"'


def setuser_commands(acls: Sequence[RoleAcl], passwords: Mapping[Role, str], prefix: str) -> str:
    """``ACL SETUSER`` lines for ``redis-cli`` (which reads one command per line from a pipe)."""
    lines = []
    for acl in acls:
        args = ["ACL", "SETUSER", prefix + acl.role, *user_rules(acl, passwords[acl.role])]
        lines.append(" ".join(_quote(a) for a in args))
    return "\n".join(lines) + "\n"


def aclfile(
    acls: Sequence[RoleAcl], passwords: Mapping[Role, str], prefix: str, default_password: str
) -> str:
    """An aclfile: the default user with ``default_password`` and every permission, then the roles.

    A server started with ``--aclfile`` ignores ``requirepass``, so the default user's password must
    be in the file. The file format has no quoting: names are written as they are (the priority lists'
    separator included) and must not contain whitespace.
    """
    for acl in acls:
        for grant in acl.grants:
            for pattern in (*grant.keys, *grant.channels):
                if any(c.isspace() for c in pattern):
                    raise ConfigError(
                        f"an aclfile cannot hold {pattern!r} (whitespace); use --format commands"
                    )
    lines = [f"user default on {password_hash(default_password)} ~* &* +@all"]
    for acl in acls:
        lines.append(
            " ".join(["user", prefix + acl.role, "on", password_hash(passwords[acl.role]), *acl.rules()])
        )
    return "\n".join(lines) + "\n"


def explain(acls: Sequence[RoleAcl]) -> str:
    """Each role's purpose and, grant by grant, why and its rules: for review, without passwords."""
    lines = []
    for acl in acls:
        lines.append(f"{acl.role}: {acl.summary}")
        for grant in acl.grants:
            lines += [f"  {grant.why}:", "    " + " ".join(_quote(r) for r in grant.rules())]
    return "\n".join(lines) + "\n"


def role_password_env(role: str) -> str:
    """The environment variable that holds ``role``'s password unless ``--password-from-env`` names one."""
    return f"REDIS_{role.upper()}_PASSWORD"


def _passwords(roles: Sequence[Role], specs: Sequence[str], environ: Mapping[str, str]) -> dict[Role, str]:
    variables: dict[Role, str] = {role: role_password_env(role) for role in roles}
    for spec in specs:
        role_name, sep, variable = spec.rpartition("=")
        if not sep:
            if len(roles) != 1:
                raise ConfigError(f"--password-from-env {spec}: several roles chosen, write ROLE={spec}")
            role_name = roles[0]
        if role_name not in roles:
            raise ConfigError(f"--password-from-env {spec}: {role_name!r} is not one of the chosen roles")
        variables[role_name] = variable  # type: ignore[index]
    missing = [v for v in variables.values() if not environ.get(v)]
    if missing:
        raise ConfigError(
            f"set {', '.join(missing)} to the role users' passwords (URL-safe, e.g. `openssl rand -hex 24`)"
        )
    return {role: environ[v] for role, v in variables.items()}


def render(
    settings: Settings,
    roles: Sequence[Role],
    fmt: Format,
    environ: Mapping[str, str],
    password_specs: Sequence[str] = (),
    prefix: str = DEFAULT_USER_PREFIX,
    default_password_env: str = DEFAULT_PASSWORD_ENV,
) -> str:
    """What ``carpool acl`` prints."""
    acls = role_acls(settings)
    chosen = [acls[r] for r in roles]
    if fmt == "explain":
        return explain(chosen)
    passwords = _passwords(roles, password_specs, environ)
    if fmt == "commands":
        return setuser_commands(chosen, passwords, prefix)
    default_password = environ.get(default_password_env)
    if not default_password:
        raise ConfigError(
            f"set {default_password_env}: an aclfile replaces requirepass, "
            "so it holds the default user's password"
        )
    return aclfile(chosen, passwords, prefix, default_password)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``acl`` on the ``carpool`` command's subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "acl",
        help="Redis ACL users per role (producer, coordinator, worker, flower), as commands or an aclfile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--role",
        action="append",
        choices=[*ROLES, "all"],
        help="a role to print (repeatable; default all)",
    )
    p.add_argument(
        "--format",
        choices=get_args(Format),
        default="commands",
        help=(
            "commands: ACL SETUSER lines for `redis-cli -a $REDIS_PASSWORD`; aclfile: for --aclfile; "
            "explain: each role's rules and why, without passwords"
        ),
    )
    p.add_argument(
        "--password-from-env",
        action="append",
        default=[],
        metavar="[ROLE=]VAR",
        help="read a role's password from VAR (default REDIS_<ROLE>_PASSWORD)",
    )
    p.add_argument(
        "--default-password-from-env",
        default=DEFAULT_PASSWORD_ENV,
        metavar="VAR",
        help="aclfile only: the default user's password (default REDIS_PASSWORD)",
    )
    p.add_argument("--user-prefix", default=DEFAULT_USER_PREFIX, help="user names are PREFIX + role")
    p.set_defaults(func=run_cli)
    return p


def run_cli(args: argparse.Namespace) -> int:
    from carpool.config import load_settings

    wanted = args.role or ["all"]
    roles: list[Role] = list(ROLES) if "all" in wanted else list(dict.fromkeys(wanted))
    text = render(
        load_settings(),
        roles,
        args.format,
        os.environ,
        args.password_from_env,
        args.user_prefix,
        args.default_password_from_env,
    )
    sys.stdout.write(text)
    return 0

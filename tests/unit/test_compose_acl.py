"""docker-compose.acl.yml over docker-compose.yml, checked statically: each service on its own Redis user.

The files are merged here as compose merges them (mappings key by key, ``command`` replaced,
``volumes`` joined by target) and interpolated with the role passwords set. CI starts the merged
stack with a real engine (.ci/compose-stack.sh, scripts/compose_acl_check.py).
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from carpool.cli import build_parser
from carpool.tools import acl
from tests.unit.test_compose import CI_STAGE, COMPOSE, DOCKERFILE, OPERATIONS, argv, environment, interpolate

ROOT = Path(__file__).resolve().parents[2]
ACL_COMPOSE = ROOT / "docker-compose.acl.yml"
CHECKER = ROOT / "scripts" / "compose_acl_check.py"
INIT = "redis-acl"
PASSWORDS = {role: f"{role}-pw-0123" for role in acl.ROLES}
ENV = {
    "REDIS_PASSWORD": "admin-pw-4567",
    **{acl.role_password_env(role): password for role, password in PASSWORDS.items()},
}


def role_of(service: dict[str, Any]) -> acl.Role:
    """The role a carpool service plays, from its command."""
    cmd = argv(service["command"])
    if cmd[:2] == ["carpool", "coordinator"]:
        return "coordinator"
    if cmd[:2] == ["carpool", "worker"]:
        return "worker"
    if cmd[:4] == ["celery", "-A", "carpool.celery_app", "flower"]:
        return "flower"
    if cmd[:2] == ["carpool", "demo"]:
        return "producer"
    raise AssertionError(f"no role for {cmd}")


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """One service of an override file merged onto the base's, by compose's rules for these keys."""
    out = dict(base)
    for key, value in over.items():
        if key in ("environment", "depends_on") and key in base:
            out[key] = {**base[key], **value}
        elif key == "volumes" and key in base:
            targets = {str(v).split(":")[1] for v in value}
            out[key] = [v for v in base[key] if str(v).split(":")[1] not in targets] + list(value)
        else:
            out[key] = value
    return out


def _interpolated(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [_interpolated(item, env) for item in node]
    if isinstance(node, dict):
        return {key: _interpolated(value, env) for key, value in node.items()}
    return node


def merged_services(env: dict[str, str] = ENV) -> dict[str, dict[str, Any]]:
    base = yaml.safe_load(COMPOSE.read_text())["services"]
    over = yaml.safe_load(ACL_COMPOSE.read_text())["services"]
    services = {name: _merge(base.get(name, {}), svc) for name, svc in over.items()}
    services.update({name: svc for name, svc in base.items() if name not in over})
    return _interpolated(services, env)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    return merged_services()


def carpool_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The services that run carpool (the base file builds them), the one-shot writer left out."""
    found = {name: svc for name, svc in services.items() if "build" in svc}
    assert {"coordinator", "worker", "worker-cpu", "flower", "demo"} <= set(found)
    return found


def test_every_carpool_service_connects_as_its_role_user(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in carpool_services(services).items():
        role = role_of(svc)
        env = environment(svc)
        for variable, db in (("CARPOOL_BROKER_URL", "/0"), ("CARPOOL_RESULT_BACKEND", "/1")):
            url = urlsplit(env[variable])
            assert (url.scheme, url.hostname, url.port, url.path) == ("redis", "redis", 6379, db), name
            assert url.username == acl.DEFAULT_USER_PREFIX + role, f"{name}: {variable} on {url.username!r}"
            assert url.password == PASSWORDS[role], f"{name}: {variable} lacks REDIS_{role.upper()}_PASSWORD"


def test_no_service_uses_the_default_user_but_redis_healthcheck(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        for url in re.findall(r"rediss?://[^\s'\"]+", yaml.safe_dump(svc)):
            assert urlsplit(url).username, f"{name}: {url} logs in as the default user"
    redis_svc = services["redis"]
    assert environment(redis_svc)["REDIS_PASSWORD"] == ENV["REDIS_PASSWORD"]
    check = " ".join(argv(redis_svc["healthcheck"]["test"]))
    assert "redis-cli" in check and '-a "$REDIS_PASSWORD"' in check and "--user" not in check


def test_role_passwords_are_required_with_a_message() -> None:
    text = ACL_COMPOSE.read_text()
    for role in acl.ROLES:
        variable = acl.role_password_env(role)
        uses = re.findall(r"\$\{" + variable + r"([^}]*)\}", text)
        assert uses and all(u.startswith(":?") and len(u) > 2 for u in uses), f"{variable}: {uses}"
        missing = {k: v for k, v in ENV.items() if k != variable}
        with pytest.raises(AssertionError, match=f"{variable}.* is required"):
            merged_services(missing)


def test_redis_loads_the_aclfile_the_one_shot_service_writes(services: dict[str, dict[str, Any]]) -> None:
    redis_svc, init = services["redis"], services[INIT]
    cmd = argv(redis_svc["command"])
    assert cmd[0] == "redis-server" and cmd[cmd.index("--appendonly") + 1] == "yes"
    assert "--requirepass" not in cmd, "--aclfile makes Redis ignore it: the file holds the default user"
    aclfile = Path(cmd[cmd.index("--aclfile") + 1])
    mounts = {str(v).split(":")[1]: str(v).split(":") for v in redis_svc["volumes"]}
    volume, _, *mode = mounts[str(aclfile.parent)]
    assert mode == ["ro"], "Redis only reads the aclfile"
    assert any(str(v).split(":")[1] == "/data" for v in redis_svc["volumes"]), "the AOF volume stays"
    assert redis_svc["depends_on"][INIT] == {"condition": "service_completed_successfully"}

    written = {str(v).split(":")[0]: str(v).split(":")[1] for v in init["volumes"]}
    assert volume in written
    words = argv(init["command"])
    assert words[:2] == ["sh", "-c"]
    script = shlex.split(words[2])
    assert script[-1] == f"{written[volume]}/{aclfile.name}", "the file Redis reads"
    assert init["image"] == "carpool:latest" and init["restart"] == "no"
    # A new volume takes the owner of the image's directory: the image's carpool user may write it.
    assert f"install -d -o carpool -g carpool {written[volume]}" in DOCKERFILE.read_text()


def test_the_one_shot_service_renders_the_default_user_then_each_role(
    services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    init = services[INIT]
    script = shlex.split(argv(init["command"])[2])
    command = script[: script.index(">")]
    assert command[0] == "carpool"
    for variable in [k for k in os.environ if k.startswith("REDIS_")]:
        monkeypatch.delenv(variable)
    for variable, value in environment(init).items():
        monkeypatch.setenv(variable, value)
    args = build_parser().parse_args(command[1:])
    assert args.func(args) == 0
    lines = capsys.readouterr().out.splitlines()

    def sha(password: str) -> str:
        return "#" + hashlib.sha256(password.encode()).hexdigest()

    assert lines[0] == f"user default on {sha(ENV['REDIS_PASSWORD'])} ~* &* +@all"
    users = {line.split()[1]: line.split()[3] for line in lines[1:]}
    assert users == {acl.DEFAULT_USER_PREFIX + role: sha(PASSWORDS[role]) for role in acl.ROLES}


def test_up_wait_accepts_the_one_shot_service(services: dict[str, dict[str, Any]]) -> None:
    """`up --wait` takes an exited container for a failure unless a running service waits for it
    with service_completed_successfully."""
    init = services[INIT]
    assert not init.get("profiles") and not init.get("healthcheck")
    adopters = [
        name
        for name, svc in services.items()
        if (svc.get("depends_on") or {}).get(INIT, {}).get("condition") == "service_completed_successfully"
        and svc.get("restart") == "unless-stopped"
    ]
    assert adopters == ["redis"]


def test_ci_and_docs_run_the_override() -> None:
    stage = CI_STAGE.read_text()
    assert stage.index("scripts/compose_check.py") < stage.index("scripts/compose_acl_check.py")
    assert "-f docker-compose.acl.yml" in stage and CHECKER.is_file()
    docs = OPERATIONS.read_text()
    assert "docker compose -f docker-compose.yml -f docker-compose.acl.yml" in docs
    assert "carpool acl --format explain" in docs

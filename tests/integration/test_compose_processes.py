"""The compose file's health checks and the Dockerfile's install steps, run for real without Docker.

The health checks run as the Python they are, against a stand-in metrics server and the session's
redis-server; the Dockerfile's pip steps run under /bin/sh with stand-ins for ``pip`` and
``python`` that record what they were asked to do. CI also runs the whole stack under a real
engine (.ci/compose-stack.sh).
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from carpool.config import Settings
from carpool.coordinator.metrics import HOUSEKEEPING_GAUGE
from carpool.tools.embedded import EmbeddedRedis
from tests.unit.test_compose import dockerfile_instructions, healthcheck_argv, load_services

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    return load_services()


def _run_check(svc: dict[str, Any], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    test = healthcheck_argv(svc)
    assert test[:3] == ["CMD", "python", "-c"], "run in exec form, so it needs no shell"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CARPOOL_")}
    return subprocess.run(
        [sys.executable, "-c", test[3]], capture_output=True, text=True, timeout=60, env={**clean, **env}
    )


# --- health checks -----------------------------------------------------------------------------
def test_coordinator_healthcheck_follows_its_loops_last_housekeeping(
    services: dict[str, dict[str, Any]],
) -> None:
    """Its metrics server answers from a thread of its own: the check reads when the loop last
    finished housekeeping with Redis, and fails once that is old (a loop stuck, or Redis gone)."""
    body = [b""]

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(body[0])

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Metrics)
    port = str(server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    env = {"CARPOOL_METRICS_PORT": port}
    try:
        body[0] = f"# carpool\n{HOUSEKEEPING_GAUGE} {time.time():.3f}\n".encode()
        up = _run_check(services["coordinator"], env)
        assert up.returncode == 0, up.stderr
        body[0] = f"# carpool\n{HOUSEKEEPING_GAUGE} {time.time() - 300:.3f}\n".encode()
        stale = _run_check(services["coordinator"], env)
        assert stale.returncode == 1 and "last reached Redis: 30" in stale.stderr
    finally:
        server.shutdown()
        server.server_close()
    down = _run_check(services["coordinator"], env)
    assert down.returncode != 0


def test_worker_healthcheck_follows_this_hosts_heartbeat(
    services: dict[str, dict[str, Any]], clean_redis: EmbeddedRedis
) -> None:
    import redis

    from carpool.redis_edge.keys import Keys
    from carpool.redis_edge.store import RequestStore

    env = {"CARPOOL_BROKER_URL": clean_redis.url(0), "CARPOOL_RESULT_BACKEND": clean_redis.url(1)}
    client = redis.Redis.from_url(clean_redis.url(0))
    store = RequestStore(client, Keys(Settings.model_fields["request_queue"].default), 30)
    for name in ("worker", "worker-cpu"):
        assert services[name]["healthcheck"] == services["worker"]["healthcheck"]

    def unhealthy(why: str) -> None:
        result = _run_check(services["worker"], env)
        # Exit 1 and nothing on stderr: the check ran and said no, rather than crashing.
        assert (result.returncode, result.stderr) == (1, ""), f"{why}: {result.stderr}"

    try:
        unhealthy("no worker yet")
        store.heartbeat("some-other-host:1", 30)
        unhealthy("only another container's worker")
        store.heartbeat(f"{socket.gethostname()}:4242", 30)
        ok = _run_check(services["worker"], env)
        assert ok.returncode == 0, ok.stderr
        store.leave(f"{socket.gethostname()}:4242")
        unhealthy("this worker left")
    finally:
        client.close()


# --- the Dockerfile's pip steps, under sh with stand-in pip and python --------------------------
STUB_PIP = """#!/bin/sh
python3 - "$@" <<'EOF'
import json, os, sys
record = {"argv": sys.argv[1:], "env": {k: v for k, v in os.environ.items() if k.startswith("PIP_")}}
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(json.dumps(record) + "\\n")
open(os.environ["STUB_TORCH"], "w").close()
EOF
"""
# `python -c "import torch..."` fails until torch is in the base image or pip installed it.
STUB_PYTHON = """#!/bin/sh
case "$2" in
  *"import torch"*) [ "$TORCH_IN_BASE" = 1 ] || [ -e "$STUB_TORCH" ] || exit 1 ;;
esac
echo "torch stub"
"""


def _dockerfile_args() -> dict[str, str]:
    """The ARGs with a default, as Docker exports them to RUN steps when no --build-arg is given."""
    out = {}
    for inst, rest in dockerfile_instructions():
        name, eq, default = rest.partition("=")
        if inst == "ARG" and eq and name != "PYTHON_IMAGE":
            out[name] = default.strip('"')
    return out


def _pip_steps() -> list[str]:
    steps = [rest for inst, rest in dockerfile_instructions() if inst == "RUN" and "pip install" in rest]
    assert len(steps) == 2, "a torch step, then the package's"
    return steps


def _run_step(tmp_path: Path, script: str, torch_in_base: bool, **build_args: str) -> list[dict[str, Any]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("pip", STUB_PIP), ("python", STUB_PYTHON)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    log, marker = tmp_path / "pip.jsonl", tmp_path / "torch-installed"
    log.unlink(missing_ok=True)
    marker.unlink(missing_ok=True)
    python3_dir = str(Path(sys.executable).parent)  # the stand-in pip runs on the real Python
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin:{python3_dir}",
        "PIP_CERT": "/etc/base-image/cert.pem",  # a setting the base image brings
        "STUB_LOG": str(log),
        "STUB_TORCH": str(marker),
        "TORCH_IN_BASE": "1" if torch_in_base else "0",
        **_dockerfile_args(),
        **build_args,
    }
    done = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_no_build_arguments_keep_the_base_images_torch_and_pip_settings(tmp_path: Path) -> None:
    torch_step, package_step = _pip_steps()
    assert _run_step(tmp_path, torch_step, torch_in_base=True) == [], "pip ran though torch was there"
    (package,) = _run_step(tmp_path, package_step, torch_in_base=True)
    assert package["argv"][-1] == ".[worker,flower]"
    assert package["env"] == {"PIP_CERT": "/etc/base-image/cert.pem"}, "the base image's pip settings"


def test_without_torch_in_the_base_pip_installs_torch_spec_from_its_own_configuration(
    tmp_path: Path,
) -> None:
    torch_step, _ = _pip_steps()
    (install,) = _run_step(tmp_path, torch_step, torch_in_base=False)
    assert install["argv"][0] == "install" and install["argv"][-1] == _dockerfile_args()["TORCH_SPEC"]
    assert "--index-url" not in install["argv"] and install["env"] == {"PIP_CERT": "/etc/base-image/cert.pem"}


def test_a_named_torch_source_wins_over_the_base_images_torch(tmp_path: Path) -> None:
    torch_step, package_step = _pip_steps()
    (install,) = _run_step(
        tmp_path,
        torch_step,
        torch_in_base=True,
        TORCH_INDEX_URL="http://index.test/cpu",
        TORCH_SPEC="torch==9",
    )
    argv = install["argv"]
    assert argv[argv.index("--index-url") + 1] == "http://index.test/cpu" and argv[-1] == "torch==9"

    extras = {"WHEELHOUSE": "wheels", "CA_BUNDLE": "ca.pem"}
    want_env = {"PIP_CERT": "/tmp/build-extras/ca.pem", "PIP_FIND_LINKS": "/tmp/build-extras/wheels"}
    for step in (torch_step, package_step):
        (install,) = _run_step(tmp_path, step, torch_in_base=True, **extras)
        assert install["env"] == want_env, step[:60]
        assert "--index-url" not in install["argv"]

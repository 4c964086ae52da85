#!/usr/bin/env bash
# CI stage: the compose stack, started by a real Docker engine (docs/OPERATIONS.md, "What CI proves").
#
# Installs the engine (docker.io) and compose v2 when missing, starts dockerd unless one already
# answers, builds the base images locally when the official ones cannot be pulled, builds carpool's
# image once (`make image`), brings up the CPU profile with generated passwords, and runs
# scripts/compose_check.py against it: results, Flower, metrics, Redis auth, then a kill -9 of each
# service's main process. Then brings the same stack up again with docker-compose.acl.yml (each
# service on its own Redis user) and runs scripts/compose_acl_check.py. Always tears the stack down
# and stops the engine it started; a failed run prints the services' logs and keeps them under $LOG_DIR.
#
# Where no engine can run, the stage fails with a banner saying so. CARPOOL_COMPOSE_STACK=skip turns
# that failure into a loud skip for machines known to have no engine.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export DEBIAN_FRONTEND=noninteractive
LOG_DIR=$ROOT/reports/tmp/compose-stack
# The checker needs carpool with the worker extra: the venv `make test` made, unless told otherwise.
PYTHON=${CARPOOL_CI_PYTHON:-$ROOT/.venv/bin/python}
PROJECT=carpool-ci
STARTED=$SECONDS
DOCKERD_PID=""
STACK_UP=""
SKIPPED=""
rm -rf "$LOG_DIR" && mkdir -p "$LOG_DIR"

say() { echo "compose-stack [$((SECONDS - STARTED))s]: $*"; }

banner() {
  local line="################################################################################"
  printf '%s\n' "$line"
  printf '## %s\n' "$@"
  printf '%s\n' "$line"
}

no_engine() {
  banner "COMPOSE STACK NOT TESTED: $1" \
    "The compose stack was not started: nothing here proves docker-compose.yml works." \
    "Run .ci/compose-stack.sh as root on a host where dockerd can start (docs/OPERATIONS.md)."
  if [ "${CARPOOL_COMPOSE_STACK:-}" = skip ]; then
    banner "CARPOOL_COMPOSE_STACK=skip: passing WITHOUT the compose stack"
    SKIPPED=1
    exit 0
  fi
  exit 1
}

# Grows by docker-compose.acl.yml for the role-user run, so that teardown sees what is up.
COMPOSE_FILES=(-f docker-compose.yml)
SERVICES=(redis coordinator worker-cpu flower)
compose() { docker compose --ansi never --env-file /dev/null "${COMPOSE_FILES[@]}" --profile cpu "$@"; }

teardown() {
  local status=$?
  set +e
  if [ -n "$STACK_UP" ]; then
    compose logs --no-color --timestamps >"$LOG_DIR/services.log" 2>&1
    if [ "$status" -ne 0 ]; then
      say "FAILED: the services' logs (last 150 lines each; all of it in $LOG_DIR/services.log)"
      for service in "${SERVICES[@]}"; do
        echo "----- $service -----"
        compose logs --no-color --timestamps --tail 150 "$service" 2>&1
      done
      compose ps -a >"$LOG_DIR/ps.txt" 2>&1 && cat "$LOG_DIR/ps.txt"
    fi
    compose --profile demo down --volumes --remove-orphans --timeout 20 >/dev/null 2>&1
  fi
  if [ -n "$DOCKERD_PID" ]; then
    docker image prune --force >/dev/null 2>&1  # the layers a rebuild left without a tag
    kill -TERM "$DOCKERD_PID" 2>/dev/null
    for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
    kill -0 "$DOCKERD_PID" 2>/dev/null && { say "dockerd did not stop; killing it"; kill -KILL "$DOCKERD_PID"; }
    say "stopped the dockerd this stage started"
  fi
  if [ "$status" -ne 0 ] && [ -f "$LOG_DIR/dockerd.log" ]; then
    say "dockerd's log (last 30 lines):"
    tail -n 30 "$LOG_DIR/dockerd.log"
  fi
  if [ -n "$SKIPPED" ]; then
    say "SKIPPED: the compose stack was not tested"
  elif [ "$status" -eq 0 ]; then
    say "passed in $((SECONDS - STARTED)) s"
  else
    say "FAILED (exit $status) in $((SECONDS - STARTED)) s; logs in $LOG_DIR"
  fi
}
trap teardown EXIT
trap 'say "failed at line $LINENO: $BASH_COMMAND"' ERR

# --- engine and compose v2 ---------------------------------------------------------------------
[ "$(id -u)" -eq 0 ] || no_engine "needs root to install and start dockerd (running as $(id -un))"
command -v apt-get >/dev/null || command -v dockerd >/dev/null || no_engine "no dockerd and no apt-get to install it"

apt_updated=""
apt_install() {
  [ -n "$apt_updated" ] || { apt-get update -qq && apt_updated=1; }
  apt-get install -y -qq --no-install-recommends "$@" >"$LOG_DIR/apt.log" 2>&1 || {
    tail -n 20 "$LOG_DIR/apt.log"
    return 1
  }
}

# The Debian mirror this host's apt uses (not the security archive), as apt itself reports it.
debian_mirror() {
  [ -z "${DEBIAN_MIRROR:-}" ] || { echo "$DEBIAN_MIRROR"; return; }
  apt-get indextargets --format '$(REPO_URI) $(LABEL) $(COMPONENT)' "Identifier: Packages" 2>/dev/null \
    | awk '$2 == "Debian" && $3 == "main" { print $1; exit }'
}

# Debian 12 ships only compose v1; Debian 13's docker-compose is v2 as one static binary. Fetch it
# with its own sources and lists, so the system's apt configuration stays as it was.
install_compose_v2() {
  local mirror work
  mirror=$(debian_mirror)
  # apt names a mirror's label only once it has fetched that mirror's Release file.
  [ -n "$mirror" ] || [ -n "$apt_updated" ] || { apt-get update -qq && apt_updated=1 && mirror=$(debian_mirror); }
  [ -n "$mirror" ] || { say "no Debian mirror in apt's configuration; set DEBIAN_MIRROR"; return 1; }
  work=$(mktemp -d)
  mkdir -p "$work/lists/partial" "$work/archives/partial"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror trixie main" >"$work/sources.list"
  local opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o Dir::Etc::SourceParts=/dev/null
    -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work" -o "Dir::Cache::Archives=$work/archives"
    -o APT::Sandbox::User=root)
  (apt-get "${opts[@]}" update -qq && cd "$work" && apt-get "${opts[@]}" download docker-compose) \
    >"$LOG_DIR/compose-download.log" 2>&1 || { tail -n 20 "$LOG_DIR/compose-download.log"; return 1; }
  dpkg-deb -x "$work"/docker-compose_*.deb "$work/root"
  install -D -m 755 "$work/root/usr/libexec/docker/cli-plugins/docker-compose" \
    /usr/local/lib/docker/cli-plugins/docker-compose
  rm -rf "$work"
}

compose_major() { { docker compose version --short 2>/dev/null || true; } | sed 's/^v//' | cut -d. -f1; }

if ! docker info >/dev/null 2>&1; then
  if ! command -v dockerd >/dev/null; then
    say "installing docker.io"
    apt_install docker.io || no_engine "could not install docker.io"
  fi
fi
major=$(compose_major)
if [ -z "$major" ] || [ "$major" -lt 2 ]; then
  say "installing compose v2 (Debian 13's docker-compose)"
  install_compose_v2 || no_engine "could not install compose v2"
fi
say "$(docker --version); $(docker compose version)"

if docker info >/dev/null 2>&1; then
  say "using the Docker engine already running"
else
  # A pid file left by a dockerd that died makes the next one refuse to start.
  if [ -f /var/run/docker.pid ] && ! kill -0 "$(cat /var/run/docker.pid)" 2>/dev/null; then
    rm -f /var/run/docker.pid
  fi
  dockerd >"$LOG_DIR/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 120); do
    docker info >/dev/null 2>&1 && break
    kill -0 "$DOCKERD_PID" 2>/dev/null || break
    sleep 0.5
  done
  if ! docker info >/dev/null 2>&1; then
    tail -n 30 "$LOG_DIR/dockerd.log"
    DOCKERD_PID=""
    no_engine "dockerd did not start (its log is above)"
  fi
  say "started dockerd (pid $DOCKERD_PID)"
fi

# --- base images -------------------------------------------------------------------------------
have_image() { docker image inspect "$1" >/dev/null 2>&1; }
# PYTHON_IMAGE / REDIS_IMAGE from the environment are used as given (docs/OPERATIONS.md).
if [ -n "${PYTHON_IMAGE:-}${REDIS_IMAGE:-}" ]; then
  PYTHON_IMAGE=${PYTHON_IMAGE:-python:3.11-slim} REDIS_IMAGE=${REDIS_IMAGE:-redis:7}
else
  PYTHON_IMAGE=python:3.11-slim REDIS_IMAGE=redis:7
  for image in "$PYTHON_IMAGE" "$REDIS_IMAGE"; do
    have_image "$image" || timeout 180 docker pull -q "$image" >>"$LOG_DIR/pull.log" 2>&1 || {
      PYTHON_IMAGE=carpool-local/python:3.11 REDIS_IMAGE=carpool-local/redis:7
      break
    }
  done
  if [ "$PYTHON_IMAGE" = carpool-local/python:3.11 ]; then
    say "official base images cannot be pulled ($(tail -n 1 "$LOG_DIR/pull.log"))"
    if have_image "$PYTHON_IMAGE" && have_image "$REDIS_IMAGE"; then
      say "using the local base images a previous run built"
    else
      say "building local base images with debootstrap"
      command -v debootstrap >/dev/null || apt_install debootstrap
      scripts/local-base-images.sh carpool-local
    fi
  fi
fi
export REDIS_IMAGE
say "base images: $PYTHON_IMAGE, $REDIS_IMAGE"

# --- carpool's image, once ---------------------------------------------------------------------
say "building carpool:latest (make image; output in $LOG_DIR/image.log)"
make image IMAGE=carpool:latest PYTHON_IMAGE="$PYTHON_IMAGE" >"$LOG_DIR/image.log" 2>&1 || {
  tail -n 60 "$LOG_DIR/image.log"
  exit 1
}
say "built carpool:latest ($(docker image inspect -f '{{.Size}}' carpool:latest | awk '{printf "%.2f GB", $1 / 1e9}'))"

# --- the stack ---------------------------------------------------------------------------------
free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export COMPOSE_PROJECT_NAME=$PROJECT BIND_ADDR=127.0.0.1
export REDIS_PASSWORD FLOWER_USER=ci FLOWER_PASSWORD REDIS_PORT METRICS_PORT FLOWER_PORT
REDIS_PASSWORD=$(od -An -tx1 -N24 /dev/urandom | tr -d ' \n')
FLOWER_PASSWORD=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
REDIS_PORT=$(free_port) METRICS_PORT=$(free_port) FLOWER_PORT=$(free_port)

# A stack left by an interrupted run would hold the project name and its Redis volume.
compose --profile demo down --volumes --remove-orphans >/dev/null 2>&1 || true
say "docker compose --profile cpu up -d --no-build --scale worker=0 --wait"
STACK_UP=1
timeout 420 docker compose --ansi never --env-file /dev/null -f docker-compose.yml --profile cpu up -d --no-build --scale worker=0 --wait
say "every service healthy"
compose ps --format 'table {{.Service}}\t{{.Status}}\t{{.Ports}}'

export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
"$PYTHON" scripts/compose_check.py

# --- the same stack, each service on its own Redis user ----------------------------------------
export REDIS_PRODUCER_PASSWORD REDIS_COORDINATOR_PASSWORD REDIS_WORKER_PASSWORD REDIS_FLOWER_PASSWORD
for role in PRODUCER COORDINATOR WORKER FLOWER; do
  printf -v "REDIS_${role}_PASSWORD" '%s' "$(od -An -tx1 -N24 /dev/urandom | tr -d ' \n')"
done
COMPOSE_FILES+=(-f docker-compose.acl.yml)
SERVICES=(redis-acl "${SERVICES[@]}")
say "docker compose -f docker-compose.yml -f docker-compose.acl.yml --profile cpu up -d --no-build --scale worker=0 --wait"
timeout 300 docker compose --ansi never --env-file /dev/null "${COMPOSE_FILES[@]}" --profile cpu up -d --no-build --scale worker=0 --wait
say "every service healthy on its own Redis user"
"$PYTHON" scripts/compose_acl_check.py

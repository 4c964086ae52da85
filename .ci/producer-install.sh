#!/usr/bin/env bash
# A producer installs carpool alone (`pip install .`, README): in a fresh virtual environment, that
# install must import the producer API and start the CLI, without the worker extra's packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
VENV=$(mktemp -d /tmp/carpool-producer.XXXXXX)
trap 'rm -rf "$VENV"' EXIT
"$PY" -m venv "$VENV"
"$VENV/bin/pip" install --quiet .
cd "$VENV"  # away from the checkout: the installed package is the one imported
"$VENV/bin/python" - <<'PY'
import sys

import carpool
import carpool.tasks
from carpool import batched, gather, submit_many  # noqa: F401

heavy = sorted(m for m in ("torch", "numpy", "tokenizers", "transformers", "prometheus_client") if m in sys.modules)
assert not heavy, f"the producer install imported {heavy}"
for m in ("torch", "numpy", "tokenizers", "transformers"):
    try:
        __import__(m)
    except ImportError:
        continue
    raise AssertionError(f"`pip install .` installed {m}, a worker's package")
print("producer install: carpool.tasks imports; no worker packages installed or imported")
PY
"$VENV/bin/carpool" --help >/dev/null
echo "producer install: carpool --help runs"

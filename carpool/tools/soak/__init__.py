"""``carpool soak``: hold an open-loop load while killing coordinators, workers and Redis, then check
that nothing was lost or answered twice, memory stayed flat and p99 came back after each fault.

The stack is a redis-server (append-only file, ``appendfsync always``), two coordinators and two
workers serving :class:`~carpool.tools.soak.model.PacedToy` (known batch time, so known capacity).
The load is Poisson at a fraction of that capacity; faults come at random intervals, each a SIGKILL
and a restart. ``run`` orchestrates, ``load`` sends and reads results, ``chaos`` owns the processes
and samples memory, ``analysis`` judges, ``report`` and ``plot`` write ``soak.json`` and ``soak.png``.
Importing this package is light: the CLI module loads on demand.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``soak`` sub-command to ``carpool``'s argument parser."""
    from carpool.tools.soak.cli import add_parser as _add_parser

    return _add_parser(subparsers)


__all__ = ["add_parser"]

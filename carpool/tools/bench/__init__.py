"""``carpool bench``: carpool against the offline limit and the Celery ways of serving the same model.

One invocation runs a seeded mixed-length workload (``carpool.tools.workload``) as a burst and at several
open-loop Poisson rates up to past saturation, against:

- ``offline``: the model alone in this process, length-sorted batches, no queue (the ceiling);
- ``carpool``: real coordinator and worker processes, requests sent with ``carpool.producer``;
- ``celery``: a plain Celery worker consuming the request queue, one task per request
  (``carpool.infer``'s body, ``run_single``);
- ``celery-batches``: a Celery worker running ``celery_batches.Batches`` (FIFO, padded to the
  longest, flush at max batch or max wait), see :mod:`carpool.tools.bench.baselines`;
- ``asyncio``: an in-process asyncio dynamic batcher (FIFO, max batch, max wait).

It writes ``report.json`` and PNG plots; ``--sweep`` maps carpool's throughput-latency curve over
max batch and max wait; ``--task`` runs a ``@batched`` task of your own through carpool,
celery-batches and plain Celery (:mod:`carpool.tools.bench.task_mode`).
Importing this package is light: the CLI module loads on demand.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``bench`` sub-command to ``carpool``'s argument parser; it runs :func:`run_cli`."""
    from carpool.tools.bench.cli import add_parser as _add_parser

    return _add_parser(subparsers)


def run_cli(args: argparse.Namespace) -> int:
    """Run the benchmark described by parsed ``args``; returns the exit status."""
    from carpool.tools.bench.cli import run_cli as _run_cli

    return _run_cli(args)


__all__ = ["add_parser", "run_cli"]

"""``carpool bench`` / ``python -m carpool.tools.bench``: options, the order of runs, report and plots.

    carpool bench                                    # minilm, every system, rates up to 1.5x offline
    carpool bench --model toy --quick --out /tmp/b   # a small, fast run
    carpool bench --sweep                            # carpool over max batch x max wait
    carpool bench --accelerator h100                 # carpool in front of a fast (simulated) device

Per system: start it (processes up, model loaded, warmed), a burst of every request at once, an
open-loop Poisson run at half the system's own burst throughput, one run per offered rate, then
``--light`` single short requests one at a time. Then, with ``--pipeline N``, a burst of N requests
through carpool and through plain Celery with the ``null`` model (no compute: the pipeline's own cost).
Rates ending in ``x`` are multiples of the offline limit measured first in the same invocation.

``--accelerator PROFILE`` is a mode of its own: carpool serving a simulated device (``v100``,
``h100``, or ``a_s,b_s``: seconds per batch and per padded token) at default settings, a burst of
mixed-length texts through ``submit_many`` + ``gather`` against the device's own capacity on them;
CPU per request by component; the device's busy fraction over time; the null model against plain
Celery's no-op tasks; a lone short request's round trip. It ignores --model, --systems and --rates.

``--task`` is another mode: a ``@batched`` task (``package.module:attribute``, or ``reranker`` with
``--model-dir``) through carpool, celery-batches running the same function and plain Celery, on
``--items FILE.jsonl`` or built-in query/passage pairs; a burst each, then any ``--rates`` (requests/s).
It ignores --model, --light and --pipeline (see :mod:`carpool.tools.bench.task_mode`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from carpool.tools.bench.report import summary_text
from carpool.tools.bench.runs import FULL, QUICK, run_bench
from carpool.tools.bench.systems import POLICY_SYSTEMS, SYSTEMS


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--model",
        default="minilm",
        help="model for every system: minilm (default), toy, null, or package.module:Class",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help=f"requests per run (default {FULL['requests']}, --quick {QUICK['requests']})",
    )
    parser.add_argument(
        "--rates",
        default=None,
        help="offered rates, comma separated: requests/s, or multiples of "
        f"the offline limit with an x suffix (default {FULL['rates']}); none = bursts only",
    )
    parser.add_argument(
        "--systems",
        default=None,
        help=f"comma separated, from {', '.join(SYSTEMS + POLICY_SYSTEMS)} (default: {', '.join(SYSTEMS)}; "
        "with --task: carpool, celery-batches, celery)",
    )
    parser.add_argument("--out", default="bench-out", help="directory for report.json, plots and logs")
    parser.add_argument("--quick", action="store_true", help="tiny counts for a fast smoke run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="max batch of every batching system (default 32; with --accelerator, carpool's setting)",
    )
    parser.add_argument(
        "--max-wait",
        type=float,
        default=None,
        help="max wait (s) of every batching system (default 0.05; with --accelerator, carpool's setting)",
    )
    parser.add_argument("--workers", type=int, default=1, help="carpool GPU-worker processes")
    parser.add_argument(
        "--coordinators",
        type=int,
        default=1,
        help="carpool coordinator processes sharing the request queue (--accelerator mode)",
    )
    parser.add_argument(
        "--light",
        type=int,
        default=None,
        help=f"single short requests, one at a time (default {FULL['light']}; 0 skips)",
    )
    parser.add_argument(
        "--pipeline",
        type=int,
        default=None,
        metavar="N",
        help=f"null-model burst of N through carpool and plain Celery (default {FULL['pipeline']}; 0 skips)",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="instead of the comparison: carpool over "
        "--sweep-batches x --sweep-waits, burst and one offered rate each",
    )
    parser.add_argument(
        "--sweep-batches", default=None, help=f"max batch values (default {FULL['sweep_batches']})"
    )
    parser.add_argument(
        "--sweep-waits", default=None, help=f"max wait values, s (default {FULL['sweep_waits']})"
    )
    parser.add_argument(
        "--sweep-rate", default="0.7x", help="offered rate of the sweep's rate runs (default 0.7x)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="run the carpool and Celery processes under cProfile: OUT/profiles/<process>.prof and .txt",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="torch CPU threads in every system (CARPOOL_TORCH_THREADS; 0 = torch's default)",
    )
    parser.add_argument("--timeout", type=float, default=600.0, help="longest wait for one run's results (s)")
    parser.add_argument(
        "--redis",
        choices=("tcp", "unix"),
        default="tcp",
        help="how every process reaches the bench's redis-server: TCP loopback (default) or its Unix socket",
    )
    parser.add_argument(
        "--accelerator",
        metavar="PROFILE",
        default=None,
        help="accelerator-regime mode on a simulated device: v100, h100, or a_s,b_s in seconds "
        "(--requests defaults to 6000, --pipeline to 20000, --light to 200)",
    )
    parser.add_argument(
        "--as-array",
        action="store_true",
        help="with --accelerator: gather the burst with gather(..., as_array=True), one numpy array, "
        "instead of lists (compare alternating runs with and without it)",
    )
    parser.add_argument(
        "--task",
        metavar="MODULE:NAME",
        default=None,
        help="benchmark a @batched task (package.module:attribute, or 'reranker': the built-in "
        "cross-encoder task over --model-dir) in carpool, celery-batches and plain Celery",
    )
    parser.add_argument(
        "--items",
        metavar="FILE.jsonl",
        default=None,
        help="the --task workload, one JSON item per line (default: built-in [query, passage] pairs)",
    )
    parser.add_argument(
        "--model-dir",
        default=None,
        help="local model directory for --task reranker (CARPOOL_BENCH_MODEL_DIR for any task module)",
    )
    return parser


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="benchmark carpool against offline, Celery and celery-batches",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure(parser)
    parser.set_defaults(func=run_cli)
    return parser


def build_parser() -> argparse.ArgumentParser:
    return configure(
        argparse.ArgumentParser(
            prog="carpool bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(build_parser().parse_args(argv))


def run_cli(args: argparse.Namespace) -> int:
    from carpool.errors import ConfigError

    if getattr(args, "task", None):
        return _run_task(args)
    if getattr(args, "items", None) or getattr(args, "model_dir", None):
        print("carpool bench: --items and --model-dir go with --task", file=sys.stderr)
        return 2
    if getattr(args, "accelerator", None):
        return _run_accelerator(args)
    try:
        report, out = run_bench(args)
    except (ConfigError, ValueError) as exc:
        print(f"carpool bench: {exc}", file=sys.stderr)
        return 2
    print(summary_text(report))
    print(f"report: {out / 'report.json'}; plots: {', '.join(report['plots']) or 'none'}")
    return 1 if report["errors"] else 0


def _run_accelerator(args: argparse.Namespace) -> int:
    from carpool.errors import ConfigError
    from carpool.tools.bench.accelerator import run_accelerator
    from carpool.tools.bench.accelerator_report import print_report

    try:
        report, out = run_accelerator(args)
    except (ConfigError, ValueError) as exc:
        print(f"carpool bench: {exc}", file=sys.stderr)
        return 2
    print_report(report)
    print(f"report: {out / 'report.json'}; plots: {', '.join(report['plots']) or 'none'}")
    return 1 if report["errors"] else 0


def _run_task(args: argparse.Namespace) -> int:
    from carpool.errors import ConfigError
    from carpool.tools.bench.task_mode import run_task
    from carpool.tools.bench.task_report import print_report

    try:
        if args.accelerator:
            raise ValueError("--task and --accelerator are separate modes; give one")
        report, out = run_task(args)
    except (ConfigError, ValueError, OSError) as exc:
        print(f"carpool bench: {exc}", file=sys.stderr)
        return 2
    print_report(report)
    print(f"report: {out / 'report.json'}")
    return 1 if report["errors"] else 0

"""``carpool soak`` / ``python -m carpool.tools.soak``: a chaos soak and its report.

    carpool soak                                   # 10 minutes, faults every 10-60 s, reports/soak/
    carpool soak --duration 300 --out /tmp/soak    # 5 minutes
    carpool soak --short                           # the test suite's one-minute soak

Exit status 0 when every invariant held, 1 when one did not (the report says which), 2 on a bad
option.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from carpool.tools.soak.config import FAULT_KINDS, SoakConfig, short_config


def _pair(text: str) -> tuple[float, float]:
    low, high = (float(v) for v in text.split(","))
    return low, high


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = SoakConfig()
    parser.add_argument("--duration", type=float, help=f"seconds of load (default {d.duration_s:g})")
    parser.add_argument(
        "--lead-in", type=float, help=f"calm seconds before the first fault (default {d.lead_in_s:g})"
    )
    parser.add_argument(
        "--tail", type=float, help=f"calm seconds after the last fault (default {d.tail_s:g})"
    )
    parser.add_argument(
        "--interval",
        type=_pair,
        help=f"LOW,HIGH seconds between faults (default {d.interval_s[0]:g},{d.interval_s[1]:g})",
    )
    parser.add_argument("--kinds", help=f"fault kinds, comma separated (default {','.join(FAULT_KINDS)})")
    parser.add_argument(
        "--load", type=float, help=f"offered load, fraction of capacity (default {d.load_fraction:g})"
    )
    parser.add_argument(
        "--window", type=float, help=f"seconds per throughput/latency window (default {d.window_s:g})"
    )
    parser.add_argument(
        "--p99-factor",
        type=float,
        help=f"recovered: p99 within this x the calm p99 (default {d.p99_factor:g})",
    )
    parser.add_argument(
        "--p99-recovery",
        type=float,
        help=f"...within this many seconds of a fault (default {d.p99_recovery_s:g})",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--short", action="store_true", help="the test suite's one-minute soak")
    parser.add_argument("--out", default="reports/soak", help="folder for soak.json, soak.png and logs/")
    return parser


def config_from(args: argparse.Namespace) -> SoakConfig:
    given: dict[str, Any] = {
        "duration_s": args.duration,
        "lead_in_s": args.lead_in,
        "tail_s": args.tail,
        "interval_s": args.interval,
        "kinds": tuple(k.strip() for k in args.kinds.split(",")) if args.kinds else None,
        "load_fraction": args.load,
        "window_s": args.window,
        "p99_factor": args.p99_factor,
        "p99_recovery_s": args.p99_recovery,
        "seed": args.seed,
    }
    given = {k: v for k, v in given.items() if v is not None}
    return short_config(**given) if args.short else SoakConfig(**given)


def run_cli(args: argparse.Namespace) -> int:
    from carpool.tools.soak.run import run_soak

    try:
        config = config_from(args)
    except ValueError as exc:
        print(f"carpool soak: {exc}", file=sys.stderr)
        return 2
    report = run_soak(config, Path(args.out))
    print(summary(report))
    return 0 if report["ok"] else 1


def summary(report: dict[str, Any]) -> str:
    c = report["counts"]
    lines = [
        f"{c['accepted']} requests accepted ({c['offered']} offered), {c['answered_ok']} answered right, "
        f"failed {c['failed_named'] or 'none'}, lost {c['lost']}, wrong {c['wrong_result']}, "
        f"changed on re-read {c['reread_changed']}, second runs refused by write-once {c['rejected_writes']}",
        f"latency p50 {report['latency_ms']['p50']} ms, p99 {report['latency_ms']['p99']} ms "
        f"(calm p99 {report['latency_ms']['calm_p99']} ms)",
    ]
    for f in report["faults"]:
        rec = "-" if f["recovery_s"] is None else f"{f['recovery_s']:.1f}s"
        lines.append(f"  t={f['at_s']:6.1f}s kill {f['target']:<13} recovery {rec:>6}  {f['verdict']}")
    for name, rule in report["invariants"].items():
        lines.append(f"{'ok  ' if rule['ok'] else 'FAIL'} {name}: {rule['detail']}")
    lines.append(f"report: {report.get('plot', '(no plot)')} and soak.json beside it")
    return "\n".join(lines)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "soak", help="hold a load while killing processes and Redis; check the aftermath"
    )
    configure(parser)
    parser.set_defaults(func=run_cli)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = configure(argparse.ArgumentParser(prog="python -m carpool.tools.soak", description=__doc__))
    return run_cli(parser.parse_args(argv))

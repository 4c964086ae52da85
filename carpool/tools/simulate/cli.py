"""``carpool simulate``'s options, and one run of them: arrivals x rates x policies, a table, a PNG."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from carpool.batching import LatencyModel, PolicyConfig
from carpool.batching.policy import PolicyKind
from carpool.tools.simulate.calibrate import calibrate
from carpool.tools.simulate.engine import POLICIES, capacity_bound, compare_configs, sorted_pass_s
from carpool.tools.simulate.report import Sweep, plot, results_table
from carpool.tools.simulate.trace import (
    TraceError,
    load_trace,
    offered_rate,
    poisson_arrivals,
    scale_to_rate,
    uniform_lengths,
    workload_lengths,
)

# Offered rates tried when none are given, as fractions of the ideal capacity (see capacity_bound):
# from light load to just past saturation, where the policies differ most.
DEFAULT_LOAD_FRACTIONS = (0.2, 0.4, 0.6, 0.8, 0.95, 1.1)
# The name `--tight-backlog both` gives binned with a deep bin cut in arrival order.
ARRIVAL_VARIANT = "binned-arrival"


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``carpool simulate`` on the top-level CLI's subparsers."""
    p = subparsers.add_parser(
        "simulate",
        help="replay arrivals through each batching policy on a simulated clock, no accelerator",
        description="Discrete-event simulation of the coordinator's batching policies. Policy knobs default "
        "to the CARPOOL_* settings. See docs/SIMULATOR.md.",
    )
    _add_arguments(p)
    p.set_defaults(func=run_cli)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    arr = p.add_argument_group("arrivals")
    arr.add_argument(
        "--trace",
        metavar="FILE",
        help="recorded arrivals: JSON lines or CSV of arrival_s,length[,priority,deadline_s] "
        "(deadline_s = seconds after arrival); replaces --lengths and --requests",
    )
    arr.add_argument(
        "--rates",
        metavar="R,R,...",
        type=_floats,
        help="offered requests/s (Poisson; a trace is time-scaled to each rate; inf: a burst, every "
        f"request at 0); default: {', '.join(f'{f:g}' for f in DEFAULT_LOAD_FRACTIONS)} x the capacity "
        "bound, or the trace as recorded",
    )
    arr.add_argument("--requests", type=int, default=2000, help="requests per run (default 2000)")
    arr.add_argument(
        "--lengths",
        default="workload",
        help="'workload' (carpool.tools.workload.mixed_texts tokenized by --model), 'accelerator' (the "
        "same with ACCELERATOR_MIX, carpool bench --accelerator's texts) or uniform:LO-HI",
    )
    arr.add_argument("--model", default="minilm", help="tokenizer for --lengths workload (default minilm)")
    arr.add_argument(
        "--deadline-s",
        type=float,
        help="deadline, seconds after arrival (default CARPOOL_DEFAULT_DEADLINE_S)",
    )
    arr.add_argument("--seed", type=int, default=0)
    lat = p.add_argument_group("latency model").add_mutually_exclusive_group()
    lat.add_argument(
        "--latency",
        metavar="A,B",
        type=_floats,
        help="batch seconds = A + B * padded tokens (default: the coordinator's prior)",
    )
    lat.add_argument(
        "--calibrate",
        metavar="MODEL",
        help="fit A,B by timing MODEL's forward here, in-process (minilm, toy, ...)",
    )
    p.add_argument(
        "--calibrate-threads",
        type=int,
        default=0,
        metavar="N",
        help="torch threads while calibrating (default: torch's own); match CARPOOL_TORCH_THREADS",
    )
    p.add_argument(
        "--overhead-s",
        type=float,
        default=0.0,
        help="pipeline seconds per batch on top of the model (hand-off, result writes)",
    )
    p.add_argument("--noise", type=float, default=0.0, help="log-sd of multiplicative run-time noise")
    pol = p.add_argument_group("pool and policy (default: CARPOOL_* settings)")
    pol.add_argument(
        "--policies",
        type=_policies,
        default=POLICIES,
        metavar="P,P,...",
        help="of fifo, shortest, binned (default all three)",
    )
    pol.add_argument("--workers", type=int, default=1)
    pol.add_argument("--prefetch-batches", type=int)
    pol.add_argument(
        "--prefetch-s", type=float, help="full batches also queue while less work than this is ahead"
    )
    pol.add_argument("--max-batch", type=int)
    pol.add_argument("--max-tokens", type=int)
    pol.add_argument("--max-wait-s", type=float)
    pol.add_argument("--wait-factor", type=float)
    pol.add_argument("--bin-edges", metavar="E,E,...", help="upper bin edges, or auto (as CARPOOL_BIN_EDGES)")
    pol.add_argument("--auto-bins", type=int, help="> 0: fit that many bins to recent lengths")
    pol.add_argument(
        "--tight-backlog",
        choices=("on", "off", "both"),
        help="binned: cut a deep bin by length (on) or arrival (off); both: run binned each way "
        "(default CARPOOL_TIGHT_BACKLOG)",
    )
    p.add_argument("--out", default="simulate.png", help="PNG plot path (default simulate.png)")


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def _policies(text: str) -> tuple[PolicyKind, ...]:
    kinds = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [k for k in kinds if k not in POLICIES]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"policies are {', '.join(POLICIES)}; got {text!r}")
    return kinds  # type: ignore[return-value]


def run_cli(args: argparse.Namespace) -> int:
    """``carpool simulate``: build arrivals, sweep rates x policies, print the table, write the PNG."""
    from rich.console import Console

    from carpool.errors import ConfigError

    console = Console()
    if not console.is_terminal:
        # Piped or captured output has no width to fit; 80 columns would wrap every row in two.
        console = Console(width=150)
    try:
        sweep = run_sweep(args, console)
    except (ConfigError, TraceError, ValueError, OSError) as exc:
        console.print(f"[red]carpool simulate:[/] {exc}")
        return 2
    console.print(results_table(sweep))
    out = Path(args.out)
    plot(sweep, out)
    console.print(f"plot written to {out}")
    return 0


def run_sweep(args: argparse.Namespace, console: Any = None) -> Sweep:
    from carpool.config import load_settings
    from carpool.coordinator import policy_config

    knobs = (
        "max_batch",
        "max_tokens",
        "max_wait_s",
        "wait_factor",
        "prefetch_batches",
        "prefetch_s",
        "auto_bins",
    )
    overrides: dict[str, object] = {k: getattr(args, k) for k in knobs if getattr(args, k) is not None}
    if args.bin_edges is not None:
        overrides["bin_edges"] = args.bin_edges
    if args.tight_backlog is not None:
        overrides["tight_backlog"] = args.tight_backlog != "off"
    settings = load_settings(**overrides)
    config = policy_config(settings)
    if args.workers < 1 or args.requests < 1:
        raise ValueError("--workers and --requests must be >= 1")
    deadline = args.deadline_s if args.deadline_s is not None else settings.default_deadline_s

    if args.calibrate:
        if console is not None:
            console.print(f"calibrating {args.calibrate} in this process...")
        a, b = calibrate(args.calibrate, threads=args.calibrate_threads)
    elif args.latency:
        if len(args.latency) != 2 or min(args.latency) < 0:
            raise ValueError("--latency takes A,B: two numbers >= 0")
        a, b = args.latency
    else:
        prior = LatencyModel()
        a, b = prior.prior_base_s, prior.prior_per_token_s
    latency = LatencyModel(prior_base_s=a, prior_per_token_s=b)

    if args.trace:
        base = load_trace(args.trace)
        lengths = [x.length for x in base]
        what = f"trace {args.trace} ({len(base)} requests)"
    else:
        lengths = _lengths(args.lengths, args.requests, args.seed, args.model)
        base = []
        what = f"{len(lengths)} requests, lengths {args.lengths}" + (
            f" ({args.model} tokens)" if args.lengths in ("workload", "accelerator") else ""
        )
    bound = capacity_bound(latency, lengths, config, args.workers, batch_overhead_s=args.overhead_s)
    if args.rates:
        rates = list(args.rates)
        if any(not r > 0 for r in rates):
            raise ValueError("--rates must be > 0 (inf: a burst)")
    elif base:
        rates = [offered_rate(base)]
    else:
        rates = [round(f * bound, 3) for f in DEFAULT_LOAD_FRACTIONS]
    configs: dict[str, PolicyConfig] = {kind: replace(config, kind=kind) for kind in args.policies}
    if args.tight_backlog == "both" and "binned" in configs:
        configs[ARRIVAL_VARIANT] = replace(config, kind="binned", tight_backlog=False)
    results = []
    offered = []  # what each run's arrivals really offer: a Poisson draw is off its nominal rate
    for rate in rates:
        if base:
            arrivals = base if not args.rates else scale_to_rate(base, rate)
            arrivals = [x if x.deadline_s is not None else replace(x, deadline_s=deadline) for x in arrivals]
        else:
            arrivals = poisson_arrivals(lengths, rate, args.seed, deadline)
        results.append(
            compare_configs(
                configs,
                latency,
                arrivals,
                workers=args.workers,
                prefetch_batches=settings.prefetch_batches,
                default_deadline_s=deadline,
                batch_overhead_s=args.overhead_s,
                noise=args.noise,
                seed=args.seed,
            )
        )
        offered.append(offered_rate(arrivals))
    description = (
        f"{what}; {args.workers} worker(s), t = {a * 1000:.3g} ms + {b * 1e6:.3g} us/token"
        + (f" + {args.overhead_s * 1000:.3g} ms/batch" if args.overhead_s else "")
        + f"; max_batch {config.max_batch}, bins {_bins(config)}"
        + ("" if config.tight_backlog else "; deep bins cut in arrival order")
    )
    sorted_s = sorted_pass_s(latency, lengths, config)
    return Sweep(offered, results, bound, (a, b), args.workers, description, sorted_s)


def _bins(config: PolicyConfig) -> str:
    edges = ",".join(map(str, config.bin_edges)) or "-"
    return f"{config.auto_bins} fitted to traffic (seeded {edges})" if config.auto_bins else edges


def _lengths(spec: str, n: int, seed: int, model: str) -> list[int]:
    if spec == "workload":
        return workload_lengths(n, seed, model)
    if spec == "accelerator":
        from carpool.tools.workload import ACCELERATOR_MIX

        return workload_lengths(n, seed, model, ACCELERATOR_MIX)
    kind, _, rest = spec.partition(":")
    low, sep, high = rest.partition("-")
    if kind == "uniform" and sep:
        try:
            return uniform_lengths(n, int(low), int(high), seed)
        except ValueError:
            pass
    raise ValueError(f"--lengths must be 'workload', 'accelerator' or uniform:LO-HI, got {spec!r}")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m carpool.tools.simulate ...``: the same command without the top-level CLI."""
    import carpool.tools.simulate as package

    parser = argparse.ArgumentParser(
        prog="carpool simulate",
        description=package.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    return run_cli(parser.parse_args(argv))

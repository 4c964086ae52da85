"""Does a change to the batching core keep every decision? This tree's policy against REV's, side by side.

    python scripts/policy_equivalence.py --base REV [--sequences 3000] [--seed 0]

Loads ``carpool/batching`` as it is at git revision REV (under another package name, so both live in
one process) and drives both policies through the same random operation sequences: adds (lengths
from a few tokens to past the window, priorities, near and far deadlines, two models with their own
limits), polls with random capacities, latency reports and revokes, under the four policy kinds,
token budgets, pad multiples, auto bins and prefetch settings. After every operation the plans
(batches, their members in order, flush reasons, padded widths), the expired requests, the wake
time, the queue size and the next deadline must be equal; the first difference is printed with the
sequence's seed and step, and the exit status is 1. For speed work on the policy, whose decisions
must not move; a change meant to move them shows up here too, as the first place it does.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import carpool.batching as current

REPO = Path(__file__).resolve().parent.parent


def batching_at(rev: str, into: Path) -> ModuleType:
    """``carpool.batching`` as at ``rev``, imported as the package ``base_batching`` from ``into``."""
    package = into / "base_batching"
    package.mkdir()
    listing = subprocess.run(
        ["git", "-C", str(REPO), "ls-tree", "--name-only", f"{rev}:carpool/batching"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for name in listing:
        if name.endswith(".py"):
            text = subprocess.run(
                ["git", "-C", str(REPO), "show", f"{rev}:carpool/batching/{name}"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            (package / name).write_text(text.replace("carpool.batching", "base_batching"))
    sys.path.insert(0, str(into))
    import base_batching  # written just above

    return base_batching  # type: ignore[no-any-return]


def _plan(plan: Any) -> tuple[Any, ...]:
    batches = [
        (b.model, b.bin_label, tuple(r.id for r in b.requests), b.padded_len, b.flush_reason.value)
        for b in plan.batches
    ]
    return batches, sorted(r.id for r in plan.expired), plan.wake_at_s


def one_sequence(seed: int, modules: tuple[ModuleType, ModuleType]) -> str | None:
    """Run sequence ``seed`` through both policies; the first difference, or None."""
    rnd = random.Random(seed)
    config = {
        "kind": rnd.choice(["binned", "binned", "fifo", "shortest"]),
        "max_batch": rnd.choice([1, 2, 3, 4, 8, 32]),
        "max_tokens": rnd.choice([64, 100, 256, 2048, 8192]),
        "max_wait_s": rnd.choice([0.0, 0.01, 0.05]),
        "wait_factor": rnd.choice([0.0, 0.3, 1.0]),
        "auto_bins": rnd.choice([0, 0, 4]),
        "tight_backlog": rnd.choice([True, False]),
        "prefetch_s": rnd.choice([0.0, 0.005]),
        "pad_multiple": rnd.choice([1, 3, 8, 16, 64]),
    }
    per_key = {}
    if rnd.random() < 0.5:  # the second model with limits of its own
        per_key["m2"] = {
            **config,
            "kind": rnd.choice(["binned", "fifo", "shortest"]),
            "max_batch": rnd.choice([2, 16]),
            "pad_multiple": rnd.choice([1, 8]),
            "auto_bins": rnd.choice([0, 3]),
        }
    prior = {"prior_base_s": rnd.choice([0.0003, 0.002]), "prior_per_token_s": rnd.choice([3.8e-6, 1e-4])}
    policies = [
        m.BatchPolicy(
            m.PolicyConfig(**config),
            m.LatencyModel(**prior),
            per_key={k: m.PolicyConfig(**v) for k, v in per_key.items()},
        )
        for m in modules
    ]
    now, ids, live = 0.0, 0, []
    for step in range(rnd.randint(20, 400)):
        where = f"sequence {seed}, step {step}"
        now += rnd.choice([0.0, 0.0, 0.0001, 0.001, 0.01, 0.05])
        op = rnd.random()
        if op < 0.55:
            for _ in range(rnd.randint(1, 40)):
                ids += 1
                fields = {
                    "id": f"r{ids}",
                    "model": rnd.choice(["m1", "m1", "m2"]),
                    "length": rnd.choice([rnd.randint(1, 30), rnd.randint(1, 300), 256, 512, 9000]),
                    "arrival_s": now - rnd.choice([0.0, 0.0, 0.002, 0.02]),
                    "deadline_s": now + rnd.choice([0.005, 0.03, 0.5, 60.0]),
                    "priority": rnd.choice([0, 0, 0, 5, -3]),
                }
                for policy, m in zip(policies, modules, strict=True):
                    policy.add(m.Request(**fields))
                live.append(fields["id"])
        elif op < 0.62:
            model, tokens = rnd.choice(["m1", "m2"]), rnd.randint(1, 5000)
            run_s = tokens * rnd.uniform(1e-6, 1e-4) + 0.001
            for policy in policies:
                policy.latency.observe(model, tokens, run_s)
        elif op < 0.67 and live:
            gone = set(rnd.sample(live, min(len(live), rnd.randint(1, 5))))
            base_gone, new_gone = (sorted(r.id for r in p.discard(gone)) for p in policies)
            if base_gone != new_gone:
                return f"{where}: discard {base_gone} != {new_gone}"
        else:
            args = (now, rnd.randint(-2, 2), rnd.randint(-1, 3), rnd.choice([0.0, 0.001, 0.02, 0.2]))
            room, incoming = rnd.randint(0, 16), rnd.random() < 0.5
            base, new = (_plan(p.poll(*args, room, incoming=incoming)) for p in policies)
            if base != new:
                return f"{where}: poll{(*args, room, incoming)}\n  base: {base}\n  this: {new}"
        if len(policies[0]) != len(policies[1]) or policies[0].next_deadline() != policies[1].next_deadline():
            return f"{where}: held {len(policies[0])} / {len(policies[1])}, next deadline differs"
    return None


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", required=True, help="git revision whose policy this tree's is held to")
    parser.add_argument("--sequences", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0, help="the first sequence's seed")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = batching_at(args.base, Path(tmp))
        for seed in range(args.seed, args.seed + args.sequences):
            difference = one_sequence(seed, (base, current))
            if difference is not None:
                print(f"decisions differ from {args.base}'s: {difference}")
                return 1
    print(f"{args.sequences} random sequences: every decision as {args.base}'s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

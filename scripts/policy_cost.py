"""CPU per request of the batching policy alone, on the accelerator bench's workload.

    python scripts/policy_cost.py [--requests 6000] [--profile v100] [--rounds 3] [--cprofile] [--base REV]

Feeds the pure policy (:class:`carpool.batching.BatchPolicy`, the coordinator's default settings)
the token lengths of ``carpool bench --accelerator``'s texts (counted with the simulated device's
tokenizer: MiniLM's), in chunks of 64 as the coordinator's intake stage admits them, polling three
times per chunk against one worker that finishes two batches between polls; then polls until every
request has left. Prints the µs per request spent in ``add`` and in ``poll`` (least of the rounds,
one process, no I/O): what the policy costs the coordinator before the contention of a bench run.
``--base REV`` also loads the policy as it is at git revision REV (``scripts/policy_equivalence.py``
checks that a change keeps its decisions) and alternates the two, round by round, in this one
process: on a noisy host a difference of a microsecond shows only that way. Then prints the median.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import statistics
import tempfile
import time
from pathlib import Path
from types import ModuleType

import carpool.batching
from carpool.config import Settings
from carpool.coordinator import policy_config
from carpool.models.simdevice import PROFILES, SimulatedDevice
from carpool.tools.workload import ACCELERATOR_MIX, mixed_texts

CHUNK = 64  # the intake stage's chunk
POLLS_PER_CHUNK = 3
SLOTS = 3  # one worker and CARPOOL_PREFETCH_BATCHES=2


def token_lengths(n: int) -> list[int]:
    """The padded lengths the coordinator would measure: MiniLM's tokens, cut at its window."""
    texts = mixed_texts(n, seed=0, mix=ACCELERATOR_MIX)
    return [len(ids) for ids in SimulatedDevice().encode(texts)]


def one_round(
    lengths: list[int], profile: str, batching: ModuleType = carpool.batching
) -> tuple[float, float, int]:
    """(µs per request in add, in poll, polls), with the policy of ``batching`` (this tree's by default)."""
    model = f"sim-{profile}"
    latency = batching.LatencyModel(
        prior_base_s=PROFILES[profile].a_s, prior_per_token_s=PROFILES[profile].b_s
    )
    config = policy_config(Settings())
    policy = batching.BatchPolicy(
        batching.PolicyConfig(**{f: getattr(config, f) for f in config.__slots__}), latency
    )
    ids = itertools.count()
    now, add_s, poll_s, polls = 0.0, 0.0, 0.0, 0
    outstanding: list[float] = []  # predicted seconds of each batch handed to the worker

    def poll(incoming: bool) -> None:
        nonlocal outstanding, poll_s, polls, now
        outstanding = outstanding[2:]
        start = time.perf_counter()
        plan = policy.poll(
            now, 1 - len(outstanding), SLOTS - len(outstanding), sum(outstanding), 16, incoming=incoming
        )
        poll_s += time.perf_counter() - start
        polls += 1
        outstanding += [latency.predict(model, b.size * b.padded_len) for b in plan.batches]
        now += 0.002

    for first in range(0, len(lengths), CHUNK):
        start = time.perf_counter()
        for length in lengths[first : first + CHUNK]:
            policy.add(batching.Request(f"r{next(ids)}", model, length, arrival_s=0.0, deadline_s=60.0))
        add_s += time.perf_counter() - start
        for _ in range(POLLS_PER_CHUNK):
            poll(incoming=first + CHUNK < len(lengths))
    while len(policy):
        poll(incoming=False)
    n = len(lengths)
    return add_s / n * 1e6, poll_s / n * 1e6, polls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--profile", default="v100", choices=sorted(PROFILES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cprofile", action="store_true", help="also print one round's cProfile")
    parser.add_argument("--base", help="git revision whose policy to alternate with this tree's")
    args = parser.parse_args()
    lengths = token_lengths(args.requests)
    if args.base:
        from policy_equivalence import batching_at

        with tempfile.TemporaryDirectory() as tmp:
            trees = {args.base: batching_at(args.base, Path(tmp)), "this tree": carpool.batching}
            polls_us: dict[str, list[float]] = {name: [] for name in trees}
            adds_us: dict[str, list[float]] = {name: [] for name in trees}
            for _ in range(args.rounds):
                for name, batching in trees.items():
                    add_us, poll_us, _ = one_round(lengths, args.profile, batching)
                    adds_us[name].append(add_us)
                    polls_us[name].append(poll_us)
        for name in trees:
            print(
                f"{name:>10}: add {statistics.median(adds_us[name]):.2f} µs, "
                f"poll {statistics.median(polls_us[name]):.2f} µs per request (median of {args.rounds})"
            )
        return
    rounds = [one_round(lengths, args.profile) for _ in range(args.rounds)]
    add_us = min(r[0] for r in rounds)
    poll_us = min(r[1] for r in rounds)
    polls = rounds[0][2]
    print(f"{args.requests} requests, {polls} polls: add {add_us:.2f} µs, poll {poll_us:.2f} µs per request")
    if args.cprofile:
        profiler = cProfile.Profile()
        profiler.runcall(one_round, lengths, args.profile)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()

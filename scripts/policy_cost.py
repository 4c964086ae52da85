"""CPU per request of the batching policy alone, on the accelerator bench's workload.

    python scripts/policy_cost.py [--requests 6000] [--profile v100] [--rounds 3] [--cprofile]

Feeds the pure policy (:class:`carpool.batching.BatchPolicy`, the coordinator's default settings)
the token lengths of ``carpool bench --accelerator``'s texts (counted with the simulated device's
tokenizer: MiniLM's), in chunks of 64 as the coordinator's intake stage admits them, polling three
times per chunk against one worker that finishes two batches between polls; then polls until every
request has left. Prints the µs per request spent in ``add`` and in ``poll`` (least of the rounds,
one process, no I/O): what the policy costs the coordinator before the contention of a bench run.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import time

from carpool.batching import BatchPolicy, LatencyModel, Request
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


def one_round(lengths: list[int], profile: str) -> tuple[float, float, int]:
    """(µs per request in add, in poll, polls)."""
    model = f"sim-{profile}"
    latency = LatencyModel(prior_base_s=PROFILES[profile].a_s, prior_per_token_s=PROFILES[profile].b_s)
    policy = BatchPolicy(policy_config(Settings()), latency)
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
            policy.add(Request(f"r{next(ids)}", model, length, arrival_s=0.0, deadline_s=60.0))
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
    args = parser.parse_args()
    lengths = token_lengths(args.requests)
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

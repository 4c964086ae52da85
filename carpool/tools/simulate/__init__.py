"""``carpool simulate``: replay arrivals through the real batching policy on a simulated clock.

Data flow::

    arrivals: Poisson at a rate with token lengths (the seeded mixed workload, tokenized by a model's
              own tokenizer, or uniform), or a recorded trace file (JSON lines or CSV)       [trace]
      -> Request objects whose times are simulated seconds
      -> carpool.batching.BatchPolicy, the coordinator's own policy object, polled at every event
         (arrival, batch report, the policy's own wake-up time) with free_workers, free_slots and
         ahead_s computed by the coordinator's capacity rules                                [engine]
      -> a simulated worker pool: dispatched batches queue first-in first-out and each runs for the
         latency model's prediction a + b * padded_tokens (x seeded noise) plus a per-batch overhead;
         members already past their deadline when a worker starts the batch fail there, as they do in
         carpool.gpu_worker.runtime
      -> reports back to the policy's latency model (the coordinator's online fit)
      -> SimResult per policy and offered rate: throughput, p50/p99 latency, padding ratio, mean batch
         size, deadline misses -> a rich table and a matplotlib PNG                    [report, cli]

The core (``simulate`` and the arrival helpers) is pure: no Redis, Celery, torch or wall clock, and a
seed fixes every random draw, so the same inputs give the same numbers on any machine. Only
``calibrate`` (times ``run_padded`` in this process) and ``workload_lengths`` (a model's tokenizer)
touch a model.
"""

from __future__ import annotations

from carpool.tools.simulate.calibrate import CALIBRATION_SHAPES, calibrate, fit_linear
from carpool.tools.simulate.cli import DEFAULT_LOAD_FRACTIONS, add_parser, main, run_cli, run_sweep
from carpool.tools.simulate.engine import (
    POLICIES,
    BatchRecord,
    SimResult,
    capacity_bound,
    compare,
    compare_configs,
    simulate,
    sorted_pass_s,
)
from carpool.tools.simulate.report import Sweep, plot, results_table
from carpool.tools.simulate.trace import (
    Arrival,
    TraceError,
    burst_arrivals,
    load_trace,
    offered_rate,
    poisson_arrivals,
    scale_to_rate,
    uniform_lengths,
    workload_lengths,
    write_trace,
)
from carpool.tools.stats import percentile

__all__ = [
    "CALIBRATION_SHAPES",
    "DEFAULT_LOAD_FRACTIONS",
    "POLICIES",
    "Arrival",
    "BatchRecord",
    "SimResult",
    "Sweep",
    "TraceError",
    "add_parser",
    "burst_arrivals",
    "calibrate",
    "capacity_bound",
    "compare",
    "compare_configs",
    "fit_linear",
    "load_trace",
    "main",
    "offered_rate",
    "percentile",
    "plot",
    "poisson_arrivals",
    "results_table",
    "run_cli",
    "run_sweep",
    "scale_to_rate",
    "simulate",
    "sorted_pass_s",
    "uniform_lengths",
    "workload_lengths",
    "write_trace",
]

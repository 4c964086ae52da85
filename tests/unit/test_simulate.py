"""The simulator under its own simulated clock: plain numbers in, the real BatchPolicy in the middle."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from carpool.batching import LatencyModel, PolicyConfig
from carpool.errors import ConfigError
from carpool.tools.simulate import (
    POLICIES,
    Arrival,
    TraceError,
    add_parser,
    burst_arrivals,
    capacity_bound,
    compare,
    compare_configs,
    fit_linear,
    load_trace,
    offered_rate,
    poisson_arrivals,
    run_cli,
    scale_to_rate,
    simulate,
    sorted_pass_s,
    uniform_lengths,
    workload_lengths,
    write_trace,
)

# 10 ms + 0.1 ms per padded token: a small GPU-ish model, the same numbers test_policy uses.
LATENCY = LatencyModel(prior_base_s=0.01, prior_per_token_s=1e-4)


@pytest.fixture(scope="module")
def mixed_lengths() -> list[int]:
    # The toy tokenizer is pure Python: the mixed workload's shape without loading anything.
    return workload_lengths(600, seed=3, model="toy")


def config(kind: str = "binned", **kw: object) -> PolicyConfig:
    return PolicyConfig(kind=kind, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", POLICIES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_request_completes_exactly_once_or_is_a_miss(kind: str, seed: int) -> None:
    lengths = uniform_lengths(400, 3, 200, seed)
    # Tight deadlines under overload, so all three outcomes happen: done, expired in queue, and
    # expired at the worker (dispatched, then past the deadline when the worker starts it).
    arrivals = [
        Arrival(a.arrival_s, a.length, priority=i % 3, deadline_s=0.05 + (i % 7) * 0.1)
        for i, a in enumerate(poisson_arrivals(lengths, 400.0, seed))
    ]
    r = simulate(config(kind), LATENCY, arrivals, workers=2, noise=0.2, seed=seed)
    ran = [rid for b in r.batches for rid in b.ran_ids]
    dispatched = [rid for b in r.batches for rid in b.request_ids]
    assert len(ran) == len(set(ran)) == r.completed
    assert len(dispatched) == len(set(dispatched))
    assert set(ran).isdisjoint(r.missed_ids)
    assert len(r.missed_ids) == len(set(r.missed_ids)) == r.missed
    assert set(ran) | set(r.missed_ids) == {f"r{i}" for i in range(len(arrivals))}
    assert r.completed + r.missed == r.requests
    assert r.missed > 0 and r.completed > 0
    assert len(r.latencies_s) == r.completed and min(r.latencies_s) > 0


def test_deadline_misses_are_counted_not_run() -> None:
    # 1 s of work per request on one worker, 20 requests at once, 2.5 s to live: batches start at
    # 0, 1 and 2 s; the rest miss, whether they expire in the queue or at the worker.
    slow = LatencyModel(prior_base_s=1.0, prior_per_token_s=0.0)
    r = simulate(config("fifo", max_batch=1), slow, burst_arrivals([10] * 20, deadline_s=2.5))
    assert r.completed == 3
    assert r.missed == 17
    assert r.late == 1  # started at 2 s, done at 3 s: the worker answers it, after its deadline


def test_binned_pads_less_than_fifo_on_the_mixed_workload(mixed_lengths: list[int]) -> None:
    for rate in (100.0, 400.0, math.inf):
        results = compare(config(), LATENCY, poisson_arrivals(mixed_lengths, rate, seed=1))
        # Not just less: FIFO pads the short majority to the long tail, bins keep each near its own length.
        assert results["binned"].padding_ratio < 0.5 * results["fifo"].padding_ratio, rate


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("kind", POLICIES)
def test_throughput_never_exceeds_the_latency_models_bound(
    mixed_lengths: list[int], kind: str, workers: int
) -> None:
    cfg = config(kind)
    bound = capacity_bound(LATENCY, mixed_lengths, cfg, workers, batch_overhead_s=0.002)
    for fraction in (0.5, 1.0, 2.0, 10.0):
        arrivals = poisson_arrivals(mixed_lengths, fraction * bound, seed=4)
        r = simulate(cfg, LATENCY, arrivals, workers=workers, batch_overhead_s=0.002)
        assert r.completed == len(mixed_lengths)
        assert 0 < r.throughput <= bound * (1 + 1e-9)
        assert r.utilisation <= 1 + 1e-9
    burst = simulate(cfg, LATENCY, burst_arrivals(mixed_lengths), workers=workers, batch_overhead_s=0.002)
    assert burst.throughput <= bound * (1 + 1e-9)


def test_light_load_throughput_follows_the_offered_rate(mixed_lengths: list[int]) -> None:
    r = simulate(config(), LATENCY, poisson_arrivals(mixed_lengths, 20.0, seed=0))
    assert r.throughput == pytest.approx(r.offered_rate, rel=0.05)
    assert r.p50_s < 0.1  # nobody waits long behind an idle worker


def test_deterministic_for_a_seed(mixed_lengths: list[int]) -> None:
    def run(seed: int) -> tuple[object, ...]:
        r = simulate(config(), LATENCY, poisson_arrivals(mixed_lengths, 300.0, seed), noise=0.3, seed=seed)
        return (r.throughput, tuple(r.latencies_s), r.padded_tokens, tuple(b.request_ids for b in r.batches))

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_the_callers_latency_model_is_not_modified(mixed_lengths: list[int]) -> None:
    latency = LatencyModel(prior_base_s=0.01, prior_per_token_s=1e-4)
    simulate(config(), latency, poisson_arrivals(mixed_lengths, 300.0), noise=0.3)
    assert latency.coefficients("sim") == (0.01, 1e-4)


def test_more_workers_never_lower_throughput_at_saturation(mixed_lengths: list[int]) -> None:
    arrivals = burst_arrivals(mixed_lengths)
    one = simulate(config(), LATENCY, arrivals, workers=1)
    two = simulate(config(), LATENCY, arrivals, workers=2)
    assert two.throughput > one.throughput * 1.3


def test_arrival_helpers() -> None:
    lengths = [5] * 1001
    arrivals = poisson_arrivals(lengths, 50.0, seed=2)
    assert arrivals[0].arrival_s == 0.0
    assert offered_rate(arrivals) == pytest.approx(50.0, rel=0.1)
    assert offered_rate(scale_to_rate(arrivals, 200.0)) == pytest.approx(200.0)
    assert offered_rate(burst_arrivals([1, 2, 3])) == math.inf
    with pytest.raises(ValueError):
        poisson_arrivals(lengths, 0.0)
    assert all(3 <= n <= 9 for n in uniform_lengths(100, 3, 9))


def test_fit_linear_recovers_a_line() -> None:
    a, b = fit_linear([(x, 0.004 + 2e-5 * x) for x in (16, 128, 512, 2048)])
    assert a == pytest.approx(0.004)
    assert b == pytest.approx(2e-5)
    with pytest.raises(ValueError):
        fit_linear([(16, 0.1), (16, 0.2)])


# --- traces -----------------------------------------------------------------------------------------


def test_trace_round_trip_through_json_lines(tmp_path: Path) -> None:
    arrivals = [Arrival(0.0, 12), Arrival(0.5, 40, priority=2, deadline_s=1.5), Arrival(0.25, 7)]
    path = tmp_path / "trace.jsonl"
    write_trace(path, arrivals)
    loaded = load_trace(path)
    assert loaded == sorted(arrivals, key=lambda a: a.arrival_s)


def test_trace_csv_with_and_without_header(tmp_path: Path) -> None:
    plain = tmp_path / "plain.csv"
    plain.write_text("# recorded 2024-05-01\n0.0,12\n0.1,30,1,2.5\n\n0.05,8,,\n")
    assert load_trace(plain) == [Arrival(0.0, 12), Arrival(0.05, 8), Arrival(0.1, 30, 1, 2.5)]
    named = tmp_path / "named.csv"
    named.write_text("length,arrival_s,deadline_s\n12,0.2,\n30,0.1,0.5\n")
    assert load_trace(named) == [Arrival(0.1, 30, 0, 0.5), Arrival(0.2, 12)]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("0.0,0\n", "length"),
        ("0.0,2.5\n", "length"),
        ("-1,10\n", "arrival_s"),
        ("0.0,10,0,-3\n", "deadline_s"),
        ("0.0,10,0,1,extra\n", "columns"),
        ("time,length\n0,10\n", "unknown column"),
        ('{"arrival_s": 0.1}\n', "missing length"),
        ('{"arrival_s": 0.1, "length": 5}\n{oops\n', ":2:"),
        ("", "no arrivals"),
    ],
)
def test_bad_traces_name_the_problem(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(content)
    with pytest.raises(TraceError, match=message):
        load_trace(path)


def test_a_trace_drives_the_simulation_with_its_own_deadlines(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    # One long job then short ones with a deadline it makes them miss.
    path.write_text("0.0,256\n" + "".join("0.001,8,0,0.005\n" for _ in range(5)))
    slow = LatencyModel(prior_base_s=0.05, prior_per_token_s=0.0)
    r = simulate(config("fifo", max_batch=1, max_wait_s=0.0), slow, load_trace(path))
    assert r.completed == 1 and r.missed == 5


# --- CLI --------------------------------------------------------------------------------------------


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="carpool")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_prints_the_table_and_writes_the_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plots" / "sim.png"
    args = parse(
        [
            "simulate",
            "--model",
            "toy",
            "--requests",
            "300",
            "--rates",
            "50,150",
            "--latency",
            "0.01,0.0001",
            "--out",
            str(out),
        ]
    )
    assert args.func is run_cli
    assert run_cli(args) == 0
    printed = capsys.readouterr().out
    for word in ("fifo", "shortest", "binned", "throughput", "p99", "padding", "misses", "capacity bound"):
        assert word in printed
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_cli_hands_the_queue_knobs_to_the_policy_it_simulates(monkeypatch: pytest.MonkeyPatch) -> None:
    import carpool.tools.simulate.cli as cli

    seen: list[tuple[dict[str, PolicyConfig], int]] = []
    real = compare_configs

    def spy(configs: dict[str, PolicyConfig], *args: object, **kwargs: object) -> object:
        seen.append((configs, int(kwargs["prefetch_batches"])))  # type: ignore[call-overload]
        return real(configs, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cli, "compare_configs", spy)
    base = ["simulate", "--model", "toy", "--requests", "100", "--rates", "inf", "--latency", "0.001,1e-6"]
    cli.run_sweep(parse([*base, "--prefetch-s", "0.5", "--prefetch-batches", "3", "--policies", "binned"]))
    (configs, prefetch_batches), *_ = seen
    assert [c.prefetch_s for c in configs.values()] == [0.5] and prefetch_batches == 3
    with pytest.raises(ConfigError, match="CARPOOL_PREFETCH_S"):
        cli.run_sweep(parse([*base, "--prefetch-s", "-1"]))


def test_cli_replays_a_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, poisson_arrivals(uniform_lengths(200, 4, 120), 80.0))
    out = tmp_path / "t.png"
    args = parse(
        ["simulate", "--trace", str(trace), "--policies", "fifo,binned", "--noise", "0.1", "--out", str(out)]
    )
    assert run_cli(args) == 0
    printed = capsys.readouterr().out
    assert "binned" in printed and "shortest" not in printed
    assert out.exists()


def test_cli_plots_a_burst_trace(tmp_path: Path) -> None:
    trace = tmp_path / "burst.csv"
    trace.write_text("arrival_s,length\n" + "".join(f"0,{n}\n" for n in uniform_lengths(100, 4, 200)))
    out = tmp_path / "burst.png"
    assert run_cli(parse(["simulate", "--trace", str(trace), "--out", str(out)])) == 0
    assert out.exists()


def test_cli_reports_bad_input_not_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("0,0\n")
    assert run_cli(parse(["simulate", "--trace", str(bad), "--out", str(tmp_path / "x.png")])) == 2
    assert "length" in capsys.readouterr().out
    assert run_cli(parse(["simulate", "--lengths", "zipf", "--out", str(tmp_path / "x.png")])) == 2
    with pytest.raises(SystemExit):
        parse(["simulate", "--policies", "lifo"])


def test_tight_backlog_changes_only_the_deep_queue(mixed_lengths: list[int]) -> None:
    """A burst: padding near a sorted pass; light load: the very same batches and latencies."""
    configs = {"tight": config(), "arrival": config(tight_backlog=False)}
    burst = compare_configs(configs, LATENCY, burst_arrivals(mixed_lengths))
    sorted_s = sorted_pass_s(LATENCY, mixed_lengths, config())
    assert burst["tight"].device_s <= 1.02 * sorted_s < burst["arrival"].device_s
    assert burst["tight"].padding_ratio < burst["arrival"].padding_ratio
    light = compare_configs(configs, LATENCY, poisson_arrivals(mixed_lengths, 10.0))
    assert light["tight"].batches == light["arrival"].batches
    assert light["tight"].latencies_s == light["arrival"].latencies_s


def test_cli_runs_a_burst_with_binned_both_ways(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "both.png"
    argv = ["simulate", "--model", "toy", "--lengths", "accelerator", "--requests", "400"]
    argv += ["--rates", "inf,20", "--policies", "binned", "--tight-backlog", "both"]
    argv += ["--latency", "0.01,0.0001", "--out", str(out)]
    assert run_cli(parse(argv)) == 0
    printed = capsys.readouterr().out
    assert "binned-arrival" in printed and "device/sorted" in printed and "inf" in printed
    assert out.exists()

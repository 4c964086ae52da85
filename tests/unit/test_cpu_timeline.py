"""Cores per component over a run: sampling, bucketing, and the device-waiting / saturated split."""

from __future__ import annotations

import pytest

from carpool.tools.bench.accelerator import _by_role, cpu_over_run, without_sampler
from carpool.tools.bench.cpu_timeline import CpuSampler, cores_per_bucket, starved_and_saturated


def test_steady_use_gives_the_same_cores_in_every_bucket_whatever_the_sample_times() -> None:
    # 1.5 cores for the coordinator, 0.5 for the worker, sampled at uneven times
    times = [10.0, 10.013, 10.04, 10.07, 10.101, 10.15, 10.2]
    samples = [(t, {"coordinator": 1.5 * (t - 10), "worker": 0.5 * (t - 10)}) for t in times]
    cores = cores_per_bucket(samples, 10.0, 10.2, 0.05)
    assert cores["coordinator"] == pytest.approx([1.5] * 4, abs=1e-3)
    assert cores["worker"] == pytest.approx([0.5] * 4, abs=1e-3)


def test_a_burst_of_cpu_lands_in_its_bucket_and_a_short_last_bucket_is_scaled() -> None:
    samples = [(0.0, {"p": 0.0}), (0.1, {"p": 0.0}), (0.15, {"p": 0.05}), (0.25, {"p": 0.05})]
    cores = cores_per_bucket(samples, 0.0, 0.22, 0.1)
    assert cores["p"] == pytest.approx([0.0, 0.5, 0.0], abs=1e-3)
    # the last bucket is 20 ms long: 10 ms of CPU in it is half a core
    tail = cores_per_bucket([(0.0, {"p": 0.0}), (0.2, {"p": 0.0}), (0.22, {"p": 0.01})], 0.0, 0.22, 0.1)
    assert tail["p"][-1] == pytest.approx(0.5, abs=1e-3)
    assert cores_per_bucket(samples[:1], 0.0, 1.0, 0.1) == {"p": []}
    with pytest.raises(ValueError):
        cores_per_bucket(samples, 0.0, 1.0, 0.0)


def test_the_sampler_sums_a_components_processes_and_keeps_the_last_reading_of_one_gone() -> None:
    cpu = {1: 1.0, 2: 2.0, 3: 5.0}
    now = [0.0]

    def read(pid: int) -> float:
        if pid not in cpu:
            raise OSError("gone")
        return cpu[pid]

    sampler = CpuSampler({"worker": [1, 2], "redis": [3]}, read=read, clock=lambda: now[0])
    sampler.sample()
    cpu[1], now[0] = 1.5, 1.0
    del cpu[2]  # the second worker exited
    sampler.sample()
    assert sampler.samples == [(0.0, {"worker": 3.0, "redis": 5.0}), (1.0, {"worker": 3.5, "redis": 5.0})]


def test_the_sampler_thread_reads_until_stopped() -> None:
    ticks = iter(range(1_000_000))
    sampler = CpuSampler({"me": [0]}, interval_s=0.001, read=lambda pid: float(next(ticks))).start()
    import time

    deadline = time.monotonic() + 5.0  # only a hang takes that long
    while len(sampler.samples) < 3:
        assert time.monotonic() < deadline, "the sampler thread stopped sampling"
        time.sleep(0.01)
    samples = sampler.stop()
    assert len(samples) >= 3
    values = [s[1]["me"] for s in samples]
    assert values == sorted(values)
    assert sampler.own_cpu_s > 0.0  # its thread's own CPU, for the bench to take off the producer's


def test_the_samplers_cpu_comes_off_the_producers_by_wall_time() -> None:
    # 0.4 s of sampling over a run of 1 s submitting and 3 s gathering: a quarter of it in submit.
    assert without_sampler(0.5, 2.0, 1.0, 3.0, 0.4) == pytest.approx((0.4, 1.7))
    assert without_sampler(0.05, 2.0, 1.0, 3.0, 0.4) == pytest.approx((0.0, 1.7)), "never below zero"
    assert without_sampler(0.5, 2.0, 0.0, 0.0, 0.4) == pytest.approx((0.5, 1.6))


def test_waiting_and_saturated_buckets_are_split_by_the_device_busy_fraction() -> None:
    cores = {"coordinator": [1.0, 0.2, 0.9, 0.1], "worker": [0.8, 0.1, 0.7, 0.3]}
    split = starved_and_saturated(cores, [0.2, 1.0, 0.4, 0.95])
    assert split["device_waiting"] == {
        "buckets": 2,
        "total_cores": pytest.approx(1.7),
        "cores": {"coordinator": pytest.approx(0.95), "worker": pytest.approx(0.75)},
    }
    assert split["device_saturated"]["buckets"] == 2
    assert split["device_saturated"]["total_cores"] == pytest.approx(0.35)
    none = starved_and_saturated(cores, [0.7, 0.7, 0.7, 0.7])
    assert none["device_waiting"] == {"buckets": 0, "total_cores": None, "cores": {}}


def test_the_reports_cpu_over_run_follows_the_device_buckets() -> None:
    samples = [(t / 100, {"coordinator": t / 100, "producer": 0.0}) for t in range(0, 21)]
    over = cpu_over_run(samples, 0.0, 0.2, {"bucket_s": 0.1, "buckets": [0.3, 0.95]})
    assert over["components"]["coordinator"] == pytest.approx([1.0, 1.0], abs=1e-3)
    assert over["total"] == pytest.approx([1.0, 1.0], abs=1e-3)
    assert over["whole_run"]["total_cores"] == pytest.approx(1.0, abs=1e-3)
    assert over["device_waiting"]["buckets"] == 1 and over["device_saturated"]["buckets"] == 1


def test_harness_processes_are_grouped_by_role() -> None:
    pids = {"carpool-coordinator": 1, "carpool-worker0": 2, "carpool-worker1": 3, "redis-server": 4}
    assert _by_role({**pids, "producer": 9, "something-else": 7}) == {
        "coordinator": [1],
        "worker": [2, 3],
        "redis": [4],
        "producer": [9],
    }

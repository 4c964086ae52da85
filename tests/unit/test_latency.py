from __future__ import annotations

import random

import pytest

from carpool.batching import LatencyModel


def test_prior_until_data() -> None:
    m = LatencyModel(prior_base_s=0.002, prior_per_token_s=1e-4)
    assert m.predict("x", 1000) == pytest.approx(0.102)


def test_fit_recovers_a_linear_cost_from_noisy_batches() -> None:
    rng = random.Random(1)
    m = LatencyModel(decay=0.995)
    for _ in range(400):
        tokens = rng.randint(8, 4096)
        m.observe("minilm", tokens, 0.004 + 2.5e-5 * tokens + rng.gauss(0, 0.0005))
    base, slope = m.coefficients("minilm")
    assert base == pytest.approx(0.004, abs=0.0005)
    assert slope == pytest.approx(2.5e-5, rel=0.05)
    # other models keep the prior
    assert m.coefficients("toy") == (m.prior_base_s, m.prior_per_token_s)


def test_follows_a_device_that_slows_down() -> None:
    m = LatencyModel(decay=0.9)
    for tokens in (100, 200, 400, 800) * 10:
        m.observe("m", tokens, 1e-5 * tokens)
    for tokens in (100, 200, 400, 800) * 10:
        m.observe("m", tokens, 3e-5 * tokens)
    assert m.predict("m", 1000) == pytest.approx(0.03, rel=0.1)


def test_one_shape_only_keeps_the_prior_slope() -> None:
    m = LatencyModel(prior_base_s=0.0, prior_per_token_s=1e-4)
    for _ in range(5):
        m.observe("m", 256, 0.05)
    assert m.predict("m", 256) == pytest.approx(0.05)
    assert m.predict("m", 512) > m.predict("m", 256)


def test_each_observation_moves_the_next_prediction() -> None:
    # Predictions between observations (as the policy asks, per queue per poll) never lag a report.
    rng = random.Random(2)
    m = LatencyModel(decay=0.95)
    seen: list[tuple[int, float]] = []
    for _ in range(50):
        tokens = rng.randint(8, 4096)
        run_s = 0.003 + rng.uniform(1e-5, 4e-5) * tokens
        m.observe("m", tokens, run_s)
        seen.append((tokens, run_s))
        fresh = LatencyModel(decay=0.95)
        for t, r in seen:
            fresh.observe("m", t, r)
        assert m.coefficients("m") == fresh.coefficients("m")
        assert m.predict("m", 1000) == fresh.predict("m", 1000)

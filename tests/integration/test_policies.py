"""Each policy through the real stack returns correct results; priorities hold end to end."""

from __future__ import annotations

import numpy as np
import pytest

from carpool.tools.workload import mixed_texts
from tests.integration.conftest import Processes, start_stack
from tests.integration.test_reliability import expected
from tests.tolerances import VECTOR_ATOL

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    "env",
    [
        {"CARPOOL_POLICY": "fifo"},
        {"CARPOOL_POLICY": "shortest"},
        {"CARPOOL_POLICY": "binned"},
        {"CARPOOL_POLICY": "binned", "CARPOOL_BIN_EDGES": "auto"},
    ],
    ids=["fifo", "shortest", "binned", "binned-auto"],
)
def test_policy_returns_correct_results(processes: Processes, env: dict[str, str]) -> None:
    from carpool.tasks import infer

    start_stack(processes, CARPOOL_MODEL="toy", CARPOOL_MODELS="toy", CARPOOL_MAX_BATCH="16", **env)
    texts = mixed_texts(150, seed=21)
    results = [infer.delay(t, model="toy") for t in texts]
    got = [r.get(timeout=60) for r in results]
    for g, w in zip(got, expected(texts), strict=True):
        assert np.allclose(g, w, atol=VECTOR_ATOL)


def test_higher_priority_runs_first(processes: Processes) -> None:
    from carpool.tasks import infer

    env = {
        "CARPOOL_MODEL": "toy",
        "CARPOOL_MODELS": "toy",
        "CARPOOL_MAX_BATCH": "10",
        "CARPOOL_POLICY": "fifo",
        # The deadline runs from the send; a loaded host's slow worker start must not reach it.
        "CARPOOL_DEFAULT_DEADLINE_S": "600",
    }
    processes.start("coordinator", "coordinator", **env)  # no worker yet: everything queues
    low = [infer.apply_async((f"low priority {i}",), {"model": "toy"}, priority=0) for i in range(40)]
    high = [infer.apply_async((f"high priority {i}",), {"model": "toy"}, priority=9) for i in range(10)]
    processes.start("worker0", "worker", **env)
    processes.wait_workers(1)
    for r in low + high:
        r.get(timeout=60)
    assert max(r.date_done for r in high) <= min(r.date_done for r in low)


def test_two_models_never_share_a_batch(processes: Processes) -> None:
    from carpool.tasks import infer

    start_stack(
        processes,
        CARPOOL_MODEL="toy",
        CARPOOL_MODELS="toy,null",
        CARPOOL_POLICY="fifo",
        CARPOOL_MAX_WAIT_S="0.2",
        CARPOOL_WAIT_FACTOR="10",
    )
    toy = [infer.delay(f"text {i} for toy", model="toy") for i in range(20)]
    null = [infer.delay(f"text {i} for null", model="null") for i in range(20)]
    assert all(len(r.get(timeout=60)) == 32 for r in toy)  # toy: 32-float vectors
    assert all(isinstance(r.get(timeout=60), int) for r in null)  # null: the token count

"""The coordinator's pacer: when it asks the policy again and how it waits, driven with numbers."""

from __future__ import annotations

import pytest

from carpool.coordinator.waiting import (
    BUSY_POLL_S,
    FORCED_POLL_S,
    REDIS_TIMEOUT_GRAIN_S,
    Pacer,
    Wait,
    WaitFor,
)

IDLE_POLL_S = 0.02


def polled_at(now: float, wake_at_s: float | None = None, idle_poll_s: float = IDLE_POLL_S) -> Pacer:
    pacer = Pacer(idle_poll_s)
    pacer.polled(now, wake_at_s)
    return pacer


# --- when the policy is asked --------------------------------------------------------------------
def test_a_new_pacer_asks_the_policy_at_once() -> None:
    assert Pacer(IDLE_POLL_S).poll_due(0.0)


def test_after_a_poll_nothing_is_due_until_the_forced_poll() -> None:
    pacer = polled_at(100.0)
    assert not pacer.poll_due(100.0)
    assert not pacer.poll_due(100.0 + FORCED_POLL_S / 2)
    assert pacer.poll_due(100.0 + FORCED_POLL_S)


def test_the_plans_wake_time_makes_a_poll_due() -> None:
    pacer = polled_at(100.0, wake_at_s=100.03)
    assert not pacer.poll_due(100.029)
    assert pacer.poll_due(100.03)


def test_a_change_makes_a_poll_due_until_the_next_poll() -> None:
    pacer = polled_at(100.0)
    pacer.changed()
    assert pacer.poll_due(100.001)
    pacer.polled(100.001, None)
    assert not pacer.poll_due(100.002)


# --- how the loop waits --------------------------------------------------------------------------
def test_after_a_full_take_the_loop_goes_on_at_once() -> None:
    wait = polled_at(100.0).next_wait(100.0, full_take=True, held=0, all_workers_busy=True)
    assert wait == Wait(0.0)


def test_a_take_short_of_the_limit_emptied_the_lists_so_the_loop_waits() -> None:
    # A lone request leaves in the step that took it; a second take would only find nothing.
    wait = polled_at(100.0).next_wait(100.0, full_take=False, held=0, all_workers_busy=True)
    assert wait == Wait(IDLE_POLL_S, WaitFor.REQUESTS)


def test_with_nothing_held_it_blocks_on_the_request_list() -> None:
    wait = polled_at(100.0).next_wait(100.0, full_take=False, held=0, all_workers_busy=False)
    assert wait == Wait(IDLE_POLL_S, WaitFor.REQUESTS)


def test_with_every_worker_busy_and_requests_held_it_blocks_on_the_report_list() -> None:
    wait = polled_at(100.0).next_wait(100.0, full_take=False, held=5, all_workers_busy=True)
    assert wait == Wait(IDLE_POLL_S, WaitFor.REPORTS)


def test_with_work_queued_on_every_worker_it_sleeps_half_of_it_and_reads_the_reports_together() -> None:
    def wait(queued_s: float, held: int = 5, wake_at_s: float | None = None) -> Wait:
        return polled_at(100.0, wake_at_s=wake_at_s).next_wait(
            100.0, full_take=False, held=held, all_workers_busy=True, queued_s=queued_s
        )

    assert wait(0.012) == Wait(0.006)  # a local sleep: the next report does not end it
    assert wait(2 * BUSY_POLL_S) == Wait(BUSY_POLL_S)
    assert wait(1.0) == Wait(IDLE_POLL_S)  # never longer than the idle poll
    # Too little queued to sleep on: the next report ends the wait, as without queued work.
    assert wait(2 * BUSY_POLL_S - 0.0001) == Wait(IDLE_POLL_S, WaitFor.REPORTS)
    assert wait(0.012, held=0) == Wait(IDLE_POLL_S, WaitFor.REQUESTS)  # nothing a slot could take
    assert wait(0.012, wake_at_s=100.05) == Wait(BUSY_POLL_S)  # the plan's time near: polled, as before
    free = polled_at(100.0).next_wait(100.0, full_take=False, held=5, all_workers_busy=False, queued_s=0.012)
    assert free == Wait(BUSY_POLL_S)  # a free worker: unchanged


def test_with_every_worker_busy_and_nothing_held_it_blocks_on_the_request_list() -> None:
    # A report would free a slot that nothing held could take; the next request's take reads it.
    wait = polled_at(100.0).next_wait(100.0, full_take=False, held=0, all_workers_busy=True)
    assert wait == Wait(IDLE_POLL_S, WaitFor.REQUESTS)


def test_a_partial_batch_with_a_free_worker_polls_briefly() -> None:
    wait = polled_at(100.0).next_wait(100.0, full_take=False, held=3, all_workers_busy=False)
    assert wait == Wait(BUSY_POLL_S)


def test_a_wake_time_later_than_the_grain_shortens_a_blocking_wait() -> None:
    pacer = polled_at(100.0, wake_at_s=100.0 + 2 * REDIS_TIMEOUT_GRAIN_S, idle_poll_s=1.0)
    wait = pacer.next_wait(100.0, full_take=False, held=0, all_workers_busy=False)
    assert wait.block_on is WaitFor.REQUESTS
    assert wait.seconds == pytest.approx(2 * REDIS_TIMEOUT_GRAIN_S)


def test_a_wake_time_within_the_grain_is_slept_locally() -> None:
    # Redis could end a blocking wait up to a grain late; a deadline must not be.
    pacer = polled_at(100.0, wake_at_s=100.05, idle_poll_s=1.0)
    wait = pacer.next_wait(100.0, full_take=False, held=0, all_workers_busy=True)
    assert wait == Wait(BUSY_POLL_S)
    wait = pacer.next_wait(100.049, full_take=False, held=0, all_workers_busy=True)
    assert wait.block_on is None and wait.seconds == pytest.approx(0.001)


def test_a_wake_time_already_past_means_no_wait() -> None:
    pacer = polled_at(100.0, wake_at_s=99.0)
    assert pacer.next_wait(100.0, full_take=False, held=2, all_workers_busy=False) == Wait(0.0)


def test_without_blmove_it_polls_instead_of_blocking() -> None:
    pacer = polled_at(100.0, idle_poll_s=1.0)
    pacer.cannot_block()
    assert pacer.next_wait(100.0, full_take=False, held=0, all_workers_busy=True) == Wait(BUSY_POLL_S)


def test_a_wait_below_redis_timeout_resolution_is_not_a_blocking_one() -> None:
    # A blocking command with a 0 timeout would wait forever.
    pacer = polled_at(100.0, idle_poll_s=0.0004)
    assert pacer.next_wait(100.0, full_take=False, held=0, all_workers_busy=False) == Wait(0.0004)


def test_a_blocking_wait_that_fails_falls_back_to_a_short_sleep() -> None:
    assert Wait(1.0, WaitFor.REQUESTS).fallback_s == BUSY_POLL_S
    assert Wait(0.001, WaitFor.REPORTS).fallback_s == 0.001


# --- requests held for their eta ----------------------------------------------------------------
def test_the_next_eta_ends_a_blocking_wait_for_requests() -> None:
    pacer = polled_at(100.0, idle_poll_s=1.0)
    wait = pacer.next_wait(100.0, full_take=False, held=0, all_workers_busy=False, next_eta_s=100.5)
    assert wait.block_on is WaitFor.REQUESTS and wait.seconds == pytest.approx(0.5)


def test_an_eta_within_the_grain_is_slept_locally_and_a_past_one_means_no_wait() -> None:
    pacer = polled_at(100.0, idle_poll_s=1.0)
    wait = pacer.next_wait(100.0, full_take=False, held=0, all_workers_busy=True, next_eta_s=100.05)
    assert wait.block_on is None and wait.seconds <= 0.05
    assert pacer.next_wait(100.0, full_take=False, held=0, all_workers_busy=False, next_eta_s=99.0) == Wait(
        0.0
    )


def test_the_sooner_of_the_plans_wake_time_and_the_next_eta_counts() -> None:
    pacer = polled_at(100.0, wake_at_s=100.3, idle_poll_s=1.0)
    late_eta = pacer.next_wait(100.0, full_take=False, held=0, all_workers_busy=False, next_eta_s=100.8)
    assert late_eta.seconds == pytest.approx(0.3)
    early_eta = pacer.next_wait(100.0, full_take=False, held=0, all_workers_busy=False, next_eta_s=100.2)
    assert early_eta.seconds == pytest.approx(0.2)


def test_while_the_intake_stage_works_a_wait_ends_with_its_next_chunk_or_the_plans_wake_time() -> None:
    pacer = polled_at(0.0, wake_at_s=0.005)
    wait = pacer.next_wait(0.0, full_take=False, held=3, all_workers_busy=False, intake_busy=True)
    assert wait == Wait(0.005, WaitFor.INTAKE)
    idle = polled_at(0.0).next_wait(0.0, full_take=False, held=0, all_workers_busy=False, intake_busy=True)
    assert idle == Wait(IDLE_POLL_S, WaitFor.INTAKE)


def test_while_the_intake_stage_works_a_full_pool_waits_for_a_chunk_and_looks_at_reports_often() -> None:
    # A finished chunk may fill batches that a fast device's queue has room for beyond the slots;
    # a report is read by the take of the step after a short wait.
    wait = polled_at(0.0).next_wait(0.0, full_take=False, held=3, all_workers_busy=True, intake_busy=True)
    assert wait == Wait(BUSY_POLL_S, WaitFor.INTAKE)
    soon = polled_at(0.0, wake_at_s=0.001).next_wait(
        0.0, full_take=False, held=3, all_workers_busy=True, intake_busy=True
    )
    assert soon == Wait(0.001, WaitFor.INTAKE)

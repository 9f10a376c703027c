"""Unit tests of the local/remote prefill decision (actors/prefill_choice.py)."""

from __future__ import annotations

import pytest

from actors.prefill_choice import PRIOR_HANDOFF_S, PRIOR_S_PER_TOKEN, Estimate, PrefillCosts, choose


def est(local_s: float, queue_s: float = 0.0, compute_s: float = 0.0, transfer_s: float = 0.0,
        handoff_s: float = 0.0) -> Estimate:
    return Estimate(local_s=local_s, queue_s=queue_s, compute_s=compute_s, transfer_s=transfer_s, handoff_s=handoff_s)


def test_the_length_floor_keeps_short_prompts_local_whatever_the_costs():
    assert choose(32, 32, est(local_s=10.0, compute_s=0.001), 0.05) == ("local", "short_prompt")
    assert choose(33, 32, est(local_s=10.0, compute_s=0.001), 0.05) == ("remote", "remote_faster")


def test_remote_when_it_reaches_the_first_token_sooner():
    assert choose(100, 0, est(local_s=0.02, compute_s=0.005, handoff_s=0.01), 1.0) == ("remote", "remote_faster")


def test_local_when_it_is_faster_and_within_the_stall_budget():
    assert choose(100, 0, est(local_s=0.04, compute_s=0.04, handoff_s=0.01), 0.05) == ("local", "local_faster")


def test_remote_when_a_local_prefill_would_stall_the_batch_past_the_budget():
    slow_remote = est(local_s=0.4, queue_s=0.3, compute_s=0.8, handoff_s=0.01)  # remote_s 1.11
    assert choose(100, 0, slow_remote, 0.05, decoding=1) == ("remote", "decode_stall")
    # nothing decoding yet: what arrives during a local prefill would wait for it, so it still counts one
    assert choose(100, 0, slow_remote, 0.05, decoding=0) == ("remote", "decode_stall")
    # an empty queue sends it remote however slow the remote side is estimated
    assert choose(100, 0, est(local_s=0.4, compute_s=5.0), 0.0, decoding=0) == ("remote", "decode_stall")


def test_the_queue_wait_is_weighed_against_the_stall_of_every_decoding_stream():
    backed_up = est(local_s=0.4, queue_s=2.0, compute_s=0.4)  # 2.0 s more for this request
    assert choose(100, 0, backed_up, 0.05, decoding=4) == ("local", "prefill_backlog")  # stalls 4 x 0.4 s
    assert choose(100, 0, backed_up, 0.05, decoding=5) == ("remote", "decode_stall")  # would stall 5 x 0.4 s


def test_estimates_start_from_the_priors():
    e = PrefillCosts().estimate(100, jobs_ahead=0)
    assert e.local_s == pytest.approx(100 * PRIOR_S_PER_TOKEN)
    assert e.compute_s == pytest.approx(100 * PRIOR_S_PER_TOKEN)
    assert e.queue_s == 0.0 and e.transfer_s == 0.0 and e.handoff_s == PRIOR_HANDOFF_S
    assert e.remote_s > e.local_s  # equal compute: the hand-off makes remote slower


def test_a_remote_prefill_teaches_compute_transfer_handoff_and_queue():
    costs = PrefillCosts()
    costs.saw_remote(100, {"queue": 0.1, "compute": 0.2, "transfer": 0.05}, total_s=0.4)
    e = costs.estimate(200, jobs_ahead=3)
    assert e.compute_s == pytest.approx(0.4)
    assert e.transfer_s == pytest.approx(0.1)
    assert e.handoff_s == pytest.approx(0.05)
    assert e.queue_s == pytest.approx(3 * 0.2)
    assert e.local_s == pytest.approx(0.4)  # not measured here yet: the same model's per-token cost


def test_a_long_job_ahead_delays_a_short_prompt_by_its_own_compute_only():
    costs = PrefillCosts()
    costs.saw_remote(2000, {"queue": 0.0, "compute": 10.0, "transfer": 0.0}, total_s=10.0)
    e = costs.estimate(100, jobs_ahead=2)  # prefill workers run the shortest prompt first
    assert e.compute_s == pytest.approx(0.5)
    assert e.queue_s == pytest.approx(2 * 0.5)
    assert costs.estimate(4000, jobs_ahead=1).queue_s == pytest.approx(10.0)


def test_local_observations_move_the_local_estimate_gradually():
    costs = PrefillCosts()
    costs.saw_local(10, 0.1)
    assert costs.estimate(10, 0).local_s == pytest.approx(0.1)
    costs.saw_local(10, 0.2)
    assert 0.1 < costs.estimate(10, 0).local_s < 0.2
    costs.saw_local(0, 5.0)  # a fully cached prompt says nothing about the cost per token
    assert costs.estimate(10, 0).local_s < 0.2


def test_a_busy_prefill_pool_sends_long_prompts_home():
    costs = PrefillCosts()
    costs.saw_remote(500, {"queue": 0.0, "compute": 1.0, "transfer": 0.0}, total_s=1.01)
    costs.saw_local(500, 1.0)
    idle, busy = costs.estimate(500, jobs_ahead=0), costs.estimate(500, jobs_ahead=2)
    assert choose(500, 32, idle, 0.05, decoding=1) == ("remote", "decode_stall")
    assert choose(500, 32, busy, 0.05, decoding=1) == ("local", "prefill_backlog")  # a 2 s queue against 1 s
    assert choose(500, 32, busy, 0.05, decoding=2) == ("remote", "decode_stall")  # against 2 x 1 s

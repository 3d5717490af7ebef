"""Scheduler behaviour on CPU with a fake runner: chunking, caps, priority, preemption, abort, static."""

from __future__ import annotations

import pytest

from engine.config import PreemptionKind
from engine.request import RequestStatus
from engine.scheduler import SchedulerOutput
from tests.support.scheduler_harness import fake_step, make_request, make_scheduler, run_to_completion


def scheduled(out):
    return {r.request_id: n for r, n in zip(out.requests, out.num_scheduled_tokens)}


def test_long_prompt_is_prefilled_in_chunks_mixed_with_decodes():
    s = make_scheduler(max_num_batched_tokens=16, num_blocks=64)
    s.add_request(make_request("short", 3, max_tokens=20))
    out, _ = fake_step(s)
    assert scheduled(out) == {"short": 3}
    s.add_request(make_request("long", 40))
    chunks = []
    for _ in range(3):
        out, _ = fake_step(s)
        got = scheduled(out)
        assert got["short"] == 1  # the decode is never starved by the prefill
        chunks.append(got["long"])
        assert sum(got.values()) <= 16
    assert chunks == [15, 15, 10]
    long_req = s.requests["long"]
    assert long_req.num_computed_tokens == 40 and long_req.num_output_tokens == 1


def test_token_budget_and_seq_cap():
    s = make_scheduler(max_num_batched_tokens=32, max_num_seqs=3, num_blocks=256)
    for i in range(6):
        s.add_request(make_request(f"r{i}", 10))
    out, _ = fake_step(s)
    assert out.total_num_scheduled_tokens <= 32
    assert len(s.running) == 3
    for _ in range(5):
        out, _ = fake_step(s)
        assert len(out.requests) <= 3
    run_to_completion(s)
    assert s.kv.num_free_blocks == 256


def test_waiting_requests_admitted_by_priority():
    s = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64)
    s.add_request(make_request("low", 4, priority=5, max_tokens=2))
    s.add_request(make_request("high", 4, priority=0, max_tokens=2))
    order = []
    for out in run_to_completion(s):
        for r in out.requests:
            if r.request_id not in order:
                order.append(r.request_id)
    assert order == ["high", "low"]


def test_aging_lets_low_priority_through_a_stream_of_high_priority():
    s = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64, priority_aging_steps=4)
    s.add_request(make_request("starving", 4, priority=10, max_tokens=1))
    admitted_at = None
    for step in range(200):
        s.add_request(make_request(f"hi{step}", 4, priority=0, max_tokens=1))
        out, _ = fake_step(s)
        if "starving" in scheduled(out):
            admitted_at = step
            break
    # 10 priority levels x 4 steps of aging, plus the queue of earlier arrivals.
    assert admitted_at is not None and admitted_at <= 10 * 4 + 2


def admission_order(s) -> list[str]:
    order = []
    for out in run_to_completion(s):
        for r in out.requests:
            if r.request_id not in order:
                order.append(r.request_id)
    return order


def test_waiting_requests_earliest_deadline_first_within_a_priority():
    s = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64)
    s.add_request(make_request("d30", 4, max_tokens=2, deadline=30.0))
    s.add_request(make_request("none1", 4, max_tokens=2))
    s.add_request(make_request("d10", 4, max_tokens=2, deadline=10.0))
    s.add_request(make_request("none2", 4, max_tokens=2))
    s.add_request(make_request("d20", 4, max_tokens=2, deadline=20.0))
    # Deadlines earliest first, then the requests without one in arrival order.
    assert admission_order(s) == ["d10", "d20", "d30", "none1", "none2"]


def test_priority_comes_before_deadline():
    s = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64)
    s.add_request(make_request("low-urgent", 4, priority=1, max_tokens=2, deadline=1.0))
    s.add_request(make_request("high-late", 4, priority=0, max_tokens=2, deadline=99.0))
    s.add_request(make_request("high-none", 4, priority=0, max_tokens=2))
    assert admission_order(s) == ["high-late", "high-none", "low-urgent"]


def test_a_request_without_deadline_is_not_starved_by_a_stream_of_deadlines():
    s = make_scheduler(max_num_seqs=1, max_num_batched_tokens=64, priority_aging_steps=4)
    s.add_request(make_request("patient", 4, max_tokens=1))
    admitted_at = None
    for step in range(100):
        s.add_request(make_request(f"urgent{step}", 4, max_tokens=1, deadline=1000.0 - step))
        out, _ = fake_step(s)
        if "patient" in scheduled(out):
            admitted_at = step
            break
    # Requests arriving aging_steps steps after it are a level behind, deadline or not.
    assert admitted_at == 4


def test_a_requeued_request_keeps_its_deadline_place():
    s = make_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=64, max_num_seqs=2,
                       preemption_mode="recompute", admission_reserve_steps=0)
    s.add_request(make_request("a", 7, max_tokens=10, deadline=5.0))
    s.add_request(make_request("b", 7, max_tokens=10))
    fake_step(s)
    s.add_request(make_request("c", 3, max_tokens=10, deadline=50.0))  # wait: max_num_seqs
    s.add_request(make_request("d", 3, max_tokens=10))
    victims = []
    for _ in range(40):
        out, _ = fake_step(s)
        victims += [r.request_id for r, _ in out.preempted]
        if victims:
            break
    assert victims == ["b"]  # no deadline: preempted before a
    # b is back in its arrival's place: after the deadline, before the newer request without one.
    waiting = s.policy.waiting
    assert [waiting.pop().request_id for _ in range(len(waiting))] == ["c", "b", "d"]


def first_victim(s) -> str:
    """Step until a step preempts a request; its id."""
    for _ in range(40):
        out, _ = fake_step(s)
        if out.preempted:
            return out.preempted[0][0].request_id
    raise AssertionError("nothing was preempted in 40 steps")


@pytest.mark.parametrize(("deadlines", "victim"), [
    ({"a": None, "b": 100.0, "c": 50.0}, "a"),  # no deadline first, though admitted first
    ({"a": 100.0, "b": 50.0, "c": 10.0}, "a"),  # then the latest deadline
    ({"a": 100.0, "b": 50.0, "c": None}, "c"),
])
def test_preemption_within_a_priority_prefers_no_deadline_then_the_latest(deadlines, victim):
    s = make_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=64,
                       preemption_mode="recompute", admission_reserve_steps=0)
    for request_id, num_tokens in (("a", 7), ("b", 7), ("c", 3)):
        s.add_request(make_request(request_id, num_tokens, max_tokens=10, deadline=deadlines[request_id]))
    fake_step(s)
    assert {r.request_id for r in s.running} == {"a", "b", "c"}
    assert first_victim(s) == victim
    run_to_completion(s)
    assert s.kv.num_free_blocks == 7


def test_preemption_picks_lowest_priority_latest_admitted():
    # 3 requests of 8 tokens with room for ~6 blocks of 4: growth must preempt.
    s = make_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=64,
                       preemption_mode="recompute", admission_reserve_steps=0)
    s.add_request(make_request("a", 7, priority=0, max_tokens=10))
    s.add_request(make_request("b", 7, priority=1, max_tokens=10))
    s.add_request(make_request("c", 3, priority=1, max_tokens=10))
    fake_step(s)  # a and b admitted (2 blocks each), c too (1 block)
    assert {r.request_id for r in s.running} == {"a", "b", "c"}
    assert first_victim(s) == "c"  # priority 1, admitted after b
    assert s.requests["c"].status == RequestStatus.WAITING
    assert s.requests["c"].num_computed_tokens == 0
    run_to_completion(s)
    assert s.kv.num_free_blocks == 7


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forced_preemption_modes_finish_everything(mode):
    s = make_scheduler(num_blocks=12, block_size=4, num_swap_blocks=64,
                       preemption_mode=mode, max_num_batched_tokens=32)
    for i in range(6):
        s.add_request(make_request(f"r{i}", 6 + i, max_tokens=12))
    outs = run_to_completion(s)
    kinds = {kind for out in outs for _, kind in out.preempted}
    assert kinds == {PreemptionKind(mode)}
    stats = s.stats()
    assert stats.num_kv_blocks_free == 12 and stats.num_swap_blocks_used == 0
    if mode == "swap":
        assert any(out.swap_in for out in outs) and any(out.swap_out for out in outs)


def test_swap_falls_back_to_recompute_when_swap_pool_full():
    s = make_scheduler(num_blocks=12, block_size=4, num_swap_blocks=6, preemption_mode="swap",
                       max_num_batched_tokens=32, admission_reserve_steps=0)
    for i in range(8):
        s.add_request(make_request(f"r{i}", 6 + i, max_tokens=16))
    run_to_completion(s)
    stats = s.stats()
    assert stats.num_preemptions_recompute > 0 and stats.num_preemptions_swap > 0


def test_auto_mode_chooses_by_cost():
    s = make_scheduler()
    model = s.cost_model
    model.prefill_seconds_per_token = 1e-3
    model.swap_bytes_per_second = 1e9
    # 1 KiB blocks: swapping 10 blocks costs ~2e-5 s, recomputing 40 tokens 4e-2 s.
    assert model.choose(40, 10) is PreemptionKind.SWAP
    model.swap_bytes_per_second = 1e3
    assert model.choose(40, 10) is PreemptionKind.RECOMPUTE


def test_auto_mode_does_not_count_what_the_prefix_cache_keeps():
    """A recompute redoes only what its readmission will not find cached, and copies back
    what the host tier gives."""
    model = make_scheduler().cost_model
    model.prefill_seconds_per_token = 1.6e-3
    model.swap_bytes_per_second = 1e6  # 1 KiB blocks: a swap's round trip of 10 is 2.05e-2 s
    assert model.choose(40, 10) is PreemptionKind.SWAP  # recomputing 40 tokens: 6.4e-2 s
    # 8 of the 10 blocks kept on the device (another request's): 8 tokens to recompute, 1.3e-2 s.
    assert model.choose(40, 10, kept=(8, 0), block_size=4) is PreemptionKind.RECOMPUTE
    # The same 8 from the host tier: and 8 copies back, 8.2e-3 s more.
    assert model.choose(40, 10, kept=(8, 8), block_size=4) is PreemptionKind.SWAP


def test_the_blocks_a_preempted_request_would_find_again():
    """num_kept_blocks: the leading blocks of a table that stay cached once it lets go of
    them, held by another table too or written through to the host tier, and of those
    the ones copied back."""
    s = make_scheduler(block_size=4, enable_prefix_caching=True)
    s.add_request(make_request("a", 18, max_tokens=8))
    fake_step(s)
    assert s.kv.num_kept_blocks("a", 4) == (0, 0)  # its own alone: evictable once let go of
    s.add_request(make_request("b", 10, max_tokens=8))  # a's first 10 tokens: 2 full blocks shared
    fake_step(s)
    assert s.kv.num_kept_blocks("a", 4) == s.kv.num_kept_blocks("b", 2) == (2, 0)
    assert s.kv.num_kept_blocks("a", 1) == (1, 0)  # as far as the readmission looks
    for num_host_blocks, kept in ((16, (4, 4)), (2, (2, 2))):  # a host tier with room for all, for 2
        tiered = make_scheduler(block_size=4, enable_prefix_caching=True, num_swap_blocks=0,
                                num_offload_blocks=num_host_blocks)
        tiered.add_request(make_request("a", 18, max_tokens=8))
        fake_step(tiered)  # a's 4 full blocks enter the cache, written through (as room allows)
        assert tiered.kv.num_kept_blocks("a", 4) == kept


def test_abort_in_every_state_frees_everything():
    s = make_scheduler(num_blocks=10, block_size=4, num_swap_blocks=16,
                       preemption_mode="swap", max_num_batched_tokens=8)
    s.add_request(make_request("prefilling", 30, max_tokens=4))  # 30 > budget: chunked
    s.add_request(make_request("waiting", 4, max_tokens=4))
    fake_step(s)
    assert s.requests["prefilling"].status == RequestStatus.RUNNING
    assert 0 < s.requests["prefilling"].num_computed_tokens < 30
    s.abort_request("prefilling")
    s.abort_request("waiting")
    s.check_integrity()
    assert s.kv.num_free_blocks == 10 and not s.has_unfinished_requests()

    for i in range(4):
        s.add_request(make_request(f"g{i}", 7, max_tokens=20))
    swapped = None
    for _ in range(60):
        fake_step(s)
        if s.swapped:
            swapped = s.swapped[0]
            break
    assert swapped is not None
    for request_id in list(s.requests):
        s.abort_request(request_id)
        s.check_integrity()
    assert s.kv.num_free_blocks == 10 and s.kv.swap_pool.num_free == 16
    assert swapped.status == RequestStatus.FINISHED_ABORTED


def test_static_policy_admits_next_batch_only_when_batch_done():
    s = make_scheduler(policy="static", max_num_seqs=2, max_num_batched_tokens=64, num_blocks=64)
    s.add_request(make_request("a", 4, max_tokens=2))
    s.add_request(make_request("b", 4, max_tokens=10))
    s.add_request(make_request("c", 4, max_tokens=2))
    seen_c_while_b_running = False
    for out in run_to_completion(s):
        ids = scheduled(out)
        if "c" in ids and s.requests.get("b") is not None:
            seen_c_while_b_running = True
    assert not seen_c_while_b_running

    cont = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64, num_blocks=64)
    for rid, n in (("a", 2), ("b", 10), ("c", 2)):
        cont.add_request(make_request(rid, 4, max_tokens=n))
    joined_early = False
    for out in run_to_completion(cont):
        if "c" in scheduled(out) and "b" in scheduled(out):
            joined_early = True
    assert joined_early


def test_admission_reserves_growth_room():
    s = make_scheduler(num_blocks=6, block_size=4, admission_reserve_steps=8,
                       max_num_batched_tokens=64)
    s.add_request(make_request("a", 8, max_tokens=4))  # 2 blocks, alone: no reserve needed
    fake_step(s)
    # b needs 2 blocks + reserve of (2 running x 8 steps / 4) = 4 -> 6 > 4 free: not admitted.
    s.add_request(make_request("b", 8, max_tokens=4))
    out, _ = fake_step(s)
    assert "b" not in scheduled(out)
    run_to_completion(s)
    assert s.requests == {}


def test_inadmissible_requests_rejected_at_add():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(make_request("too-long", 64))
    with pytest.raises(ValueError, match="KV blocks"):
        s.add_request(make_request("too-big", 10, max_tokens=40))
    s.add_request(make_request("ok", 10, max_tokens=6))
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(make_request("ok", 10, max_tokens=6))


def test_queue_times_are_bounded_and_the_mean_counts_every_request(monkeypatch):
    """A worker's life admits requests without end: the stats keep the latest queue times
    only, while the mean (and the recent window's count) cover every request."""
    from engine.scheduler import stats as stats_module

    monkeypatch.setattr(stats_module, "MAX_QUEUE_TIMES", 3)
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(6):
        s.add_request(make_request(f"r{i}", 5, max_tokens=3))
    run_to_completion(s)
    stats = s.stats()
    assert stats.num_finished == 6 and len(stats.queue_times) == 3 and s.counters.num_queued == 6
    assert stats.mean_queue_time == pytest.approx(s.counters.queue_time_total / 6)
    assert stats.recent.num_queued == 6


def test_metrics_track_queue_and_efficiency():
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(4):
        s.add_request(make_request(f"r{i}", 5, max_tokens=3))
    run_to_completion(s)
    stats = s.stats()
    assert stats.num_finished == 4 and len(stats.queue_times) == 4
    assert 0 < stats.kv_memory_efficiency <= 1
    assert stats.mean_seqs_per_step > 1
    assert stats.num_tokens_scheduled_total == 4 * 5 + 4 * 2  # prompts + decode inputs


def test_static_batch_reserves_worst_case_and_never_preempts():
    # 8 requests of 8 prompt + 8 output tokens: 15 KV tokens = 4 blocks of 4 at worst.
    # A 10-block pool holds two such reservations, so static batches are pairs,
    # while continuous batching, taking blocks as sequences grow, runs more at once.
    def run(policy):
        s = make_scheduler(num_blocks=10, block_size=4, policy=policy, max_num_seqs=8,
                           max_num_batched_tokens=64, admission_reserve_steps=0)
        for i in range(8):
            s.add_request(make_request(f"r{i}", 8, max_tokens=8))
        outs = run_to_completion(s)
        assert s.kv.num_free_blocks == 10 and s.requests == {}
        return s, outs

    static, outs = run("static")
    assert max(len(o.requests) for o in outs) == 2
    assert not any(o.preempted for o in outs)
    continuous, _ = run("continuous")
    assert continuous.stats().mean_seqs_per_step > static.stats().mean_seqs_per_step
    # Reserved-but-unused slots count against static's KV efficiency.
    assert static.stats().kv_memory_efficiency < continuous.stats().kv_memory_efficiency


def test_static_members_hold_their_reservation_from_admission():
    s = make_scheduler(num_blocks=64, block_size=4, policy="static", max_num_seqs=4,
                       max_num_batched_tokens=4, admission_reserve_steps=0)
    s.add_request(make_request("a", 10, max_tokens=7))  # peak 16 tokens: 4 blocks
    s.add_request(make_request("b", 3, max_tokens=30))  # peak 32 tokens: 8 blocks
    out, _ = fake_step(s)  # both admitted; only a's first chunk fits the budget
    assert scheduled(out) == {"a": 4}
    assert len(s.kv.get_block_ids("a")) == 4 and len(s.kv.get_block_ids("b")) == 8
    s.check_integrity()
    run_to_completion(s)
    assert s.kv.num_free_blocks == 64


def test_static_swap_after_out_of_band_preemption():
    # A member preempted from outside the scheduler comes back with its reservation.
    s = make_scheduler(num_blocks=8, num_swap_blocks=64, block_size=4, policy="static",
                       preemption_mode="swap", max_num_batched_tokens=64, admission_reserve_steps=0)
    for i in range(2):
        s.add_request(make_request(f"r{i}", 8, max_tokens=4))
    fake_step(s)
    victim = s.running[-1]
    s._preempt(victim, SchedulerOutput())
    s.check_integrity()
    assert victim.status == RequestStatus.SWAPPED
    run_to_completion(s)
    assert s.kv.num_free_blocks == 8 and s.kv.swap_pool.num_free == 64


def test_empty_table_survives_failed_growth_and_swaps():
    s = make_scheduler(num_blocks=2, num_swap_blocks=4, block_size=4)
    kv = s.kv
    assert kv.allocate_slots("a", 0) and kv.get_block_ids("a") == []
    assert not kv.allocate_slots("a", 12)  # 3 blocks > 2 free: no change, table kept
    assert kv.has_blocks("a") and kv.get_block_ids("a") == []
    assert kv.swap_out("a") == [] and kv.swap_in("a") == []
    assert not kv.allocate_slots("b", 12) and not kv.has_blocks("b")  # no table for a failed newcomer
    kv.free("a")
    kv.check_integrity()


def test_admission_counts_blocks_promised_to_prefilling_requests():
    # 4 prompts of 4 blocks each, a 10-block pool and 4-token chunks: only two fit at once.
    s = make_scheduler(num_blocks=10, block_size=4, long_prefill_token_threshold=4,
                       max_num_batched_tokens=64, admission_reserve_steps=0)
    for i in range(4):
        s.add_request(make_request(f"r{i}", 16, max_tokens=2))
    out, _ = fake_step(s)
    assert len(s.running) == 2
    outs = run_to_completion(s)
    assert not any(o.preempted for o in [out, *outs])


def test_request_that_exactly_fits_the_pool_is_admissible():
    # 16 prompt tokens + 1 output: the sampled token needs no KV, so 4 blocks of 4 suffice.
    s = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    s.add_request(make_request("fits", 16, max_tokens=1))
    run_to_completion(s)
    with pytest.raises(ValueError, match="KV blocks"):
        s.add_request(make_request("too-big", 16, max_tokens=2))


def test_swapped_requests_come_back_before_newcomers():
    s = make_scheduler(num_blocks=8, num_swap_blocks=32, block_size=4, preemption_mode="swap",
                       max_num_batched_tokens=64, admission_reserve_steps=0)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 6, max_tokens=14))
    swapped_id = None
    for _ in range(40):
        fake_step(s)
        if s.swapped:
            swapped_id = s.swapped[0].request_id
            break
    assert swapped_id is not None
    s.add_request(make_request("newcomer", 2, max_tokens=2))
    order = []
    for out in run_to_completion(s):
        order += [r.request_id for r in out.requests if r.request_id not in order]
    assert order.index(swapped_id) < order.index("newcomer")

"""Property tests: whatever the interleaving, every block is in exactly one place."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kv.block_pool import BlockPool
from engine.kv.manager import KVCacheManager
from engine.scheduler import SchedulerOutput
from tests.support.scheduler_harness import fake_step, make_request, make_scheduler


@settings(max_examples=200, deadline=None)
@given(
    num_blocks=st.integers(0, 40),
    ops=st.lists(st.tuples(st.sampled_from(["alloc", "free", "share"]), st.integers(0, 12)), max_size=60),
)
def test_block_pool_ref_counts(num_blocks, ops):
    pool = BlockPool(num_blocks)
    holders: list[list[int]] = []
    for op, n in ops:
        if op == "alloc":
            if pool.can_allocate(n):
                holders.append(pool.allocate(n))
            else:
                assert n > pool.num_free
        elif op == "free" and holders:
            pool.free(holders.pop(n % len(holders)))
        elif op == "share" and holders:
            shared = holders[n % len(holders)]
            pool.incref(shared)
            holders.append(list(shared))
        held: dict[int, int] = {}
        for table in holders:
            for block_id in table:
                held[block_id] = held.get(block_id, 0) + 1
        pool.check_integrity(held)
    for table in holders:
        pool.free(table)
    assert pool.num_free == num_blocks


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["grow", "free", "swap_out", "swap_in"]), st.integers(0, 30)), max_size=60))
def test_kv_manager_tables(ops):
    kv = KVCacheManager(num_blocks=24, num_swap_blocks=10, block_size=4, max_blocks_per_seq=16, initial_rows=2)
    sizes: dict[str, int] = {}
    swapped: set[str] = set()
    for op, n in ops:
        rid = f"r{n % 6}"
        if op == "grow" and rid not in swapped:
            target = sizes.get(rid, 0) + n
            if target <= 64 and kv.allocate_slots(rid, target):
                sizes[rid] = target
        elif op == "free":
            kv.free(rid)
            kv.free_swapped(rid)
            sizes.pop(rid, None)
            swapped.discard(rid)
        elif op == "swap_out" and kv.has_blocks(rid) and kv.can_swap_out(rid):
            kv.swap_out(rid)
            swapped.add(rid)
        elif op == "swap_in" and rid in swapped:
            if kv.swap_in(rid) is not None:
                swapped.discard(rid)
        kv.check_integrity()
    for rid in list(sizes):
        kv.free(rid)
        kv.free_swapped(rid)
    kv.check_integrity()
    assert kv.num_free_blocks == 24 and kv.swap_pool.num_free == 10


scheduler_configs = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(6, 48),
        "num_swap_blocks": st.integers(0, 40),
        "block_size": st.sampled_from([2, 4, 8]),
        "max_num_seqs": st.integers(1, 8),
        "max_num_batched_tokens": st.integers(1, 48),
        "preemption_mode": st.sampled_from(["auto", "recompute", "swap"]),
        "policy": st.sampled_from(["continuous", "static"]),
        "admission_reserve_steps": st.integers(0, 6),
        "priority_aging_steps": st.integers(1, 16),
        "long_prefill_token_threshold": st.integers(0, 16),
    }
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 48), st.integers(0, 3)),
        st.tuples(st.just("add"), st.integers(1, 8), st.integers(1, 48), st.integers(0, 3)),
        st.tuples(st.just("burst"), st.integers(2, 8), st.integers(1, 16), st.integers(8, 40)),
        st.tuples(st.just("step"), st.integers(1, 8)),
        st.tuples(st.just("abort"), st.integers(0, 1000)),
        st.tuples(st.just("preempt"), st.integers(0, 1000)),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=scheduler_configs, ops=operations, finish_by_abort=st.booleans())
def test_scheduler_interleavings_keep_every_block_in_one_place(config, ops, finish_by_abort):
    num_blocks = config["num_blocks"]
    num_swap_blocks = config["num_swap_blocks"]
    s = make_scheduler(max_model_len=256, **config)
    next_ids = iter(range(10**6))

    def add(prompt_len: int, max_tokens: int, priority: int) -> None:
        request = make_request(f"q{next(next_ids)}", prompt_len, max_tokens=max_tokens, priority=priority)
        try:
            s.add_request(request)
        except ValueError:  # only a request the whole pool could never hold is refused
            assert -(-(prompt_len + max_tokens - 1) // s.block_size) > num_blocks
    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, priority = op
            add(prompt_len, max_tokens, priority)
        elif op[0] == "burst":
            # Many short prompts with long outputs: admitted together, they outgrow the pool.
            _, count, prompt_len, max_tokens = op
            for _ in range(count):
                add(prompt_len, max_tokens, 0)
        elif op[0] == "step":
            for _ in range(op[1]):
                fake_step(s)
        elif op[0] == "abort" and s.requests:
            ids = sorted(s.requests)
            s.abort_request(ids[op[1] % len(ids)])
        elif op[0] == "preempt" and s.running:
            # An out-of-band preemption, as memory pressure from outside the scheduler would cause.
            s._preempt(s.running[op[1] % len(s.running)], SchedulerOutput())
        s.check_integrity()
    if finish_by_abort:
        for request_id in sorted(s.requests):
            s.abort_request(request_id)
    else:
        for _ in range(20_000):
            if not s.has_unfinished_requests():
                break
            fake_step(s)
    assert not s.has_unfinished_requests()
    s.check_integrity()
    assert s.kv.num_free_blocks == num_blocks
    assert s.kv.swap_pool.num_free == num_swap_blocks


def test_fresh_pool_hands_out_ascending_runs_and_reuses_a_freed_table_in_order():
    pool = BlockPool(10)
    first, second = pool.allocate(3), pool.allocate(2)
    assert (first, second) == ([0, 1, 2], [3, 4])
    pool.free(first)
    assert pool.allocate(4) == [0, 1, 2, 5]  # the freed table first, in its order

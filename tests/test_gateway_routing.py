"""The gateway's routing policy: when a prompt is prefilled on its decode worker."""

from __future__ import annotations

import pytest

from gateway.workers import RoutingPolicy


def test_defaults_hand_off_unless_the_prefill_queue_is_long():
    policy = RoutingPolicy()
    assert policy.max_local_prefill_tokens == 0 and policy.max_prefill_queue_tokens == 2048
    assert not policy.prefill_locally(1, prefill_queue=0, decode_queue=0)
    assert not policy.prefill_locally(500, prefill_queue=2048, decode_queue=0)  # at the threshold: remote
    assert policy.prefill_locally(500, prefill_queue=2049, decode_queue=0)
    assert policy.prefill_locally(500, prefill_queue=5000, decode_queue=4999)
    # The decode worker is no better off: stay remote.
    assert not policy.prefill_locally(500, prefill_queue=5000, decode_queue=5000)


def test_short_prompts_stay_local():
    policy = RoutingPolicy(max_local_prefill_tokens=32, max_prefill_queue_tokens=0)
    assert policy.prefill_locally(32, prefill_queue=0, decode_queue=10_000)
    assert not policy.prefill_locally(33, prefill_queue=0, decode_queue=0)
    assert not policy.prefill_locally(33, prefill_queue=10**9, decode_queue=0)  # queue rule off


def test_negative_thresholds_are_refused():
    with pytest.raises(ValueError):
        RoutingPolicy(max_local_prefill_tokens=-1)
    with pytest.raises(ValueError):
        RoutingPolicy(max_prefill_queue_tokens=-1)


def test_pool_counts_each_prompt_on_the_worker_that_prefills_it():
    import asyncio

    from baton.internal.v1 import worker_pb2
    from gateway.workers import WorkerPool

    async def scenario() -> None:
        pool = WorkerPool(["127.0.0.1:1"], ["127.0.0.1:2"], RoutingPolicy(max_prefill_queue_tokens=100))
        prefill, decode = pool.prefill[0], pool.decode[0]
        for worker in pool.workers:
            worker.is_up = True
        decode.stats = worker_pb2.WorkerStats(num_kv_blocks_free=1000)
        assert pool.pick_prefill(80, decode) is prefill  # queue 0: remote
        assert pool.pick_prefill(80, decode) is prefill  # queue 80 <= 100: remote
        assert prefill.queued_prefill_tokens == 160
        assert pool.pick_prefill(50, decode) is None  # queue 160 > 100, decode has 0: local
        assert (prefill.queued_prefill_tokens, decode.queued_prefill_tokens) == (160, 50)
        # The prefill worker turned out unreachable: its prompt moves to the decode worker.
        pool.prefill_moved(prefill, decode, 80)
        assert (prefill.queued_prefill_tokens, decode.queued_prefill_tokens) == (80, 130)
        prefill.is_up = False
        assert pool.pick_prefill(10, decode) is None  # no prefill worker up: colocated
        assert decode.queued_prefill_tokens == 140
        await pool.close()

    asyncio.run(scenario())

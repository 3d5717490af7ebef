"""Prefix affinity in routing: a prompt goes where its prefix is likely cached, weighed
against load (gateway/affinity.py, WorkerPool.pick_prefill / pick_decode)."""

from __future__ import annotations

from dataclasses import replace

from baton.wire.records import WorkerStats
from gateway.workers import RoutingPolicy

DEFAULTS = RoutingPolicy(0, 0)  # every prompt to a prefill worker while one is up

def _caching_worker(worker, worker_id: str, **stats) -> None:
    worker.is_up = True
    worker.stats = WorkerStats(worker_id=worker_id, role=worker.role, serving=True, block_size=4,
                               prefix_caching=True, num_kv_blocks_total=1000, num_kv_blocks_free=1000, **stats)
    worker.prefix.sync(worker_id, True, 1000)


def test_a_shared_prefix_stays_on_the_worker_that_caches_it_until_its_queue_outweighs_it():
    import asyncio

    from gateway.affinity import PromptBlocks
    from gateway.workers import WorkerPool

    async def scenario() -> None:
        pool = WorkerPool(["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:3"], RoutingPolicy(0, 0, 0))
        for worker in pool.workers:
            _caching_worker(worker, worker.address)
        decode = pool.decode[0]
        system = list(range(100, 500))  # 100 blocks of 4
        first = pool.pick_prefill(410, decode, PromptBlocks(system + list(range(10))))
        other = next(w for w in pool.prefill if w is not first)
        # Each user's prompt: the system prompt and 10 tokens of its own. The worker that
        # caches the system prompt computes 10 tokens of each; the other would compute 410.
        picks = [pool.pick_prefill(410, decode, PromptBlocks(system + [7000 + i] * 10)) for i in range(60)]
        stayed = sum(worker is first for worker in picks)
        assert stayed >= 30, "affinity should keep most of them where the prefix is cached"
        assert other in picks, "a hot prefix must not pile onto one worker without bound"
        # The load the two carry stays within about one uncached prompt of each other.
        assert abs(first.queued_prefill_tokens - other.queued_prefill_tokens) <= 410 + 10
        # A prompt with no cached prefix goes to the less loaded worker.
        fresh = pool.pick_prefill(410, decode, PromptBlocks(list(range(5000, 5410))))
        assert fresh is min(pool.prefill, key=lambda w: w.queued_prefill_tokens - (410 if w is fresh else 0))
        await pool.close()

    asyncio.run(scenario())


def test_decode_affinity_counts_held_blocks_as_free_and_forgets_a_restarted_worker():
    import asyncio

    from gateway.affinity import PromptBlocks
    from gateway.workers import WorkerPool

    async def scenario() -> None:
        pool = WorkerPool([], ["127.0.0.1:1", "127.0.0.1:2"], DEFAULTS)
        a, b = pool.decode
        _caching_worker(a, "a", num_kv_blocks_used=0)
        _caching_worker(b, "b")
        prompt = PromptBlocks(list(range(200)))  # 50 blocks

        def route(num_tokens: int, prompt: PromptBlocks):
            """As the dispatcher does: the decode worker, then the prefill worker (none here:
            the decode worker prefills), which is when the workers' indexes learn the prompt."""
            decode = pool.pick_decode(num_tokens, prompt=prompt)
            assert pool.pick_prefill(num_tokens - 1, decode, prompt) is None
            return decode

        assert route(201, prompt) is a  # a tie: the first
        assert a.pending_blocks == 51 and a.cached_blocks(prompt) == 50
        # Prefilled there: charged all of its 200 tokens (nothing was cached yet).
        assert a.pending_prefill_tokens == 200
        # b has more free blocks than a has left (990 against 949), but a holds the prompt's
        # 50: it takes 3 new blocks there, 51 on b, and a keeps more free.
        b.stats = replace(b.stats, num_kv_blocks_free=990)
        assert route(205, PromptBlocks(list(range(200)) + [1, 2, 3, 4])) is a
        assert a.pending_blocks == 51 + 2  # only what it lacks
        assert a.pending_prefill_tokens == 200 + 4
        # Load outweighs affinity: b with 1040 free keeps more free even taking all 51.
        b.stats = replace(b.stats, num_kv_blocks_free=1040)
        assert route(201, prompt) is b
        # Without affinity (another prompt), the freer worker.
        assert route(201, PromptBlocks(list(range(300, 500)))) is b
        # A restart (new worker id) or caching turned off forgets what it held.
        a.prefix.sync("a-restarted", True, 1000)
        assert a.cached_blocks(prompt) == 0
        b.prefix.sync("b", False, 1000)
        assert b.cached_blocks(PromptBlocks(list(range(300, 500)))) == 0
        await pool.close()

    asyncio.run(scenario())


def test_prefix_index_evicts_tails_before_heads():
    from gateway.affinity import PrefixIndex

    index = PrefixIndex()
    index.sync("w", True, 4)
    index.add([b"a", b"b", b"c"])
    index.add([b"x", b"y"])
    assert len(index) == 4
    assert index.matched([b"a", b"b", b"c"]) == 2  # c, the tail of the older chain, went first
    assert index.matched([b"x", b"y"]) == 2


def test_an_extended_prompt_hashes_only_its_new_blocks_and_equals_a_fresh_chain():
    from engine.kv.prefix_hash import block_hashes
    from gateway.affinity import PromptBlocks

    prompt = PromptBlocks(list(range(10)))
    assert prompt.hashes(4) == block_hashes(list(range(10)), 4)
    longer = prompt.extended(list(range(10, 19)))
    assert longer.hashes(4) == block_hashes(list(range(19)), 4)
    assert longer.hashes(4)[:2] == prompt.hashes(4) and len(prompt.hashes(4)) == 2  # the original is untouched


def test_a_worker_with_a_host_tier_is_estimated_to_keep_what_its_device_cache_evicts():
    """The host tier holds the latest host_capacity blocks (those on the device too): the
    device part's evicted blocks go on in a host part of the difference; a chain's run goes
    on there as the worker matches it; a block sent again moves back to the device part."""
    from gateway.affinity import PrefixIndex

    index = PrefixIndex()
    index.sync("w", True, 4, num_host_blocks=7)
    index.add([b"a", b"b", b"c"])
    index.add([b"x", b"y"])  # c goes to the host part
    assert index.matched_tiers([b"a", b"b", b"c", b"d"]) == (2, 1) and index.matched([b"a", b"b", b"c"]) == 2
    index.add([b"p", b"q", b"r", b"s"])  # device p q r s; host part (3): c b a y x -> a y x
    assert index.matched_tiers([b"a", b"b", b"c"]) == (0, 1)
    assert index.matched_tiers([b"x", b"y"]) == (0, 2) and len(index) == 7
    index.add([b"a"])  # back on the device; s, the device's least recent, to the host part
    assert index.matched_tiers([b"a", b"y"]) == (1, 1) and index.matched_tiers([b"s"]) == (0, 1)
    index.sync("w2", True, 4, num_host_blocks=7)  # restarted: holds nothing
    assert len(index) == 0


def test_the_prefill_side_counts_host_tier_blocks_by_what_their_copy_back_saves():
    import asyncio

    from gateway.affinity import PromptBlocks
    from gateway.workers import WorkerPool

    async def scenario() -> None:
        pool = WorkerPool(["127.0.0.1:1"], ["127.0.0.1:2"], DEFAULTS)
        worker = pool.prefill[0]
        # A token's prefill takes 1 ms; its KV (a 40 KB block of 4 tokens) copies back at 1 GB/s: 10 us.
        _caching_worker(worker, "w", num_kv_offload_blocks_total=100, prefill_s_per_token=1e-3,
                        kv_block_bytes=40_000, kv_copy_bytes_per_s=1e9)
        worker.prefix.sync("w", True, 10, num_host_blocks=100)
        prompt = PromptBlocks(list(range(100, 203)))  # 25 full blocks and 3 tokens
        worker.routed(prompt)  # the head's 10 blocks on the device, the tail's 15 in the host tier
        assert worker.prefix.matched_tiers(prompt.hashes(4)) == (10, 15)
        assert worker.host_tier_weight() == 0.99
        assert worker.cached_prefill_tokens(prompt) == round((10 + 15 * 0.99) * 4)
        worker.stats = replace(worker.stats, prefill_s_per_token=0.0)  # not measured yet: a copy saves it all
        assert worker.cached_prefill_tokens(prompt) == 100
        await pool.close()

    asyncio.run(scenario())

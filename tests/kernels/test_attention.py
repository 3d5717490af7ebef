"""Paged attention backends against dense per-sequence causal attention."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.attention import SequenceSpan, build_attention_batch, get_attention_backend

torch.set_num_threads(1)

BACKENDS = ["torch", "cpu"]  # "cpu" builds the native kernels on first use

BLOCK_SIZE = 4
NUM_BLOCKS = 48
HEAD_DIM = 16
# (tokens cached before the step, new tokens); decodes add exactly one token.
DECODES = [(0, 1), (3, 1), (4, 1), (9, 1), (22, 1)]
PREFILLS = [(0, 7), (5, 6), (8, 1), (3, 4), (0, 1)]


def dense_attention(query, keys, values, num_cached, scale):
    """Plain causal attention of one sequence over contiguous K/V, in float64.

    query [q, H, Dh] holds positions num_cached..num_cached+q-1; keys/values [C, KvH, Dh].
    """
    group = query.shape[1] // keys.shape[1]
    q = query.double().transpose(0, 1)  # [H, q, Dh]
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, C, Dh]
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q @ k.transpose(1, 2) * scale  # [H, q, C]
    query_positions = torch.arange(num_cached, num_cached + query.shape[0])
    allowed = torch.arange(keys.shape[0])[None, :] <= query_positions[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)  # [q, H, Dh]


def make_step(num_heads, num_kv_heads, dtype, seed=0, decodes=DECODES, prefills=PREFILLS, num_blocks=NUM_BLOCKS,
              block_major=False):
    """Random sequences with their prefixes already in a fresh cache, plus this step's inputs.

    block_major: the caches are layer 1's views of a KVCache-style
    [num_blocks, 3 layers, K/V, block_size, KvH, Dh] tensor (block stride = all layers)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM)
    if block_major:
        blocks = torch.randn((num_blocks, 3, 2, *shape[1:]), generator=gen).to(dtype)
        key_cache, value_cache = blocks[:, 1, 0], blocks[:, 1, 1]
    else:
        key_cache = torch.randn(shape, generator=gen).to(dtype)  # garbage outside written slots
        value_cache = torch.randn(shape, generator=gen).to(dtype)
    free_blocks = torch.randperm(num_blocks, generator=gen).tolist()

    sequences = []
    for num_cached, num_new in list(decodes) + list(prefills):
        context_len = num_cached + num_new
        num_blocks = -(-context_len // BLOCK_SIZE)
        block_ids = [free_blocks.pop() for _ in range(num_blocks)]
        keys = torch.randn(context_len, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
        values = torch.randn(context_len, num_kv_heads, HEAD_DIM, generator=gen).to(dtype)
        query = torch.randn(num_new, num_heads, HEAD_DIM, generator=gen).to(dtype)
        for position in range(num_cached):
            block, offset = block_ids[position // BLOCK_SIZE], position % BLOCK_SIZE
            key_cache[block, offset] = keys[position]
            value_cache[block, offset] = values[position]
        sequences.append((SequenceSpan(block_ids, num_cached, num_new), query, keys, values))

    spans = [seq[0] for seq in sequences]
    batch = build_attention_batch(spans[: len(decodes)], spans[len(decodes) :], BLOCK_SIZE)
    query = torch.cat([seq[1] for seq in sequences])
    key = torch.cat([seq[2][seq[0].num_cached_tokens :] for seq in sequences])
    value = torch.cat([seq[3][seq[0].num_cached_tokens :] for seq in sequences])
    return batch, sequences, query, key, value, key_cache, value_cache


TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2}


def assert_matches_reference(out, sequences, scale, dtype):
    """Each sequence's rows of the batched output equal its dense causal attention."""
    start = 0
    for span, seq_query, seq_keys, seq_values in sequences:
        end = start + span.num_new_tokens
        expected = dense_attention(seq_query, seq_keys, seq_values, span.num_cached_tokens, scale)
        torch.testing.assert_close(out[start:end].double(), expected, atol=TOLERANCES[dtype], rtol=0)
        start = end


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("block_major", [False, True], ids=["contiguous", "block_major"])
def test_backend_matches_dense_reference(backend_name, dtype, num_heads, num_kv_heads, block_major):
    batch, sequences, query, key, value, key_cache, value_cache = make_step(
        num_heads, num_kv_heads, dtype, block_major=block_major
    )
    if block_major:
        blocks = key_cache._base  # the [num_blocks, 3, 2, ...] tensor the caches view
        assert blocks is value_cache._base and blocks.shape[1:3] == (3, 2)
        others = blocks[:, [0, 2]].clone()  # the other layers' K and V
    # Wider block tables than needed, padded with 0 (a block another sequence owns).
    padded = torch.cat([batch.block_tables, torch.zeros(batch.num_seqs, 3, dtype=torch.int64)], 1)
    batch = dataclasses.replace(batch, block_tables=padded)
    batch.check_integrity(BLOCK_SIZE)

    backend = get_attention_backend(backend_name)
    metadata = backend.build_metadata(batch, BLOCK_SIZE, num_heads, num_kv_heads, HEAD_DIM, dtype)
    scale = HEAD_DIM**-0.5
    out = backend.forward(query, key, value, key_cache, value_cache, metadata, scale)

    assert out.shape == query.shape and out.dtype == dtype and out.is_contiguous()
    assert_matches_reference(out, sequences, scale, dtype)
    flat_keys = key_cache.reshape(-1, num_kv_heads, HEAD_DIM)  # a copy when block-major
    assert torch.equal(flat_keys[batch.slot_mapping], key)
    assert torch.equal(value_cache.reshape(-1, num_kv_heads, HEAD_DIM)[batch.slot_mapping], value)
    if block_major:
        assert torch.equal(blocks[:, [0, 2]], others), "a slot write landed in another layer"


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_many_decodes_and_long_chunks(backend_name, dtype):
    """More decodes than one length group holds, and long chunks with and without a cached prefix."""
    decodes = [(n, 1) for n in (0, 90, 3, 41, 7, 66, 12, 5, 130, 1, 29, 18, 77, 2, 54, 9, 33, 101, 4, 60)]
    prefills = [(37, 600), (0, 300), (250, 257)]
    num_blocks = sum(-(-(c + n) // BLOCK_SIZE) for c, n in decodes + prefills) + 8
    batch, sequences, query, key, value, key_cache, value_cache = make_step(
        8, 2, dtype, seed=3, decodes=decodes, prefills=prefills, num_blocks=num_blocks
    )
    backend = get_attention_backend(backend_name)
    metadata = backend.build_metadata(batch, BLOCK_SIZE, 8, 2, HEAD_DIM, dtype)
    assert [p.bias is None for p in metadata.prefills] == [False, True, False]
    if backend_name == "torch":
        assert len(metadata.decode_groups) > 1
    scale = HEAD_DIM**-0.5
    out = backend.forward(query, key, value, key_cache, value_cache, metadata, scale)
    assert_matches_reference(out, sequences, scale, dtype)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_strided_qkv_views_are_accepted(backend_name):
    """The model passes q/k/v as views of one fused projection."""
    num_heads, num_kv_heads, dtype = 8, 2, torch.float64
    batch, _, query, key, value, key_cache, value_cache = make_step(num_heads, num_kv_heads, dtype)
    fused = torch.cat([query, key, value], dim=1)  # [N, H + 2 KvH, Dh]
    q_view, k_view, v_view = fused.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    backend = get_attention_backend(backend_name)
    metadata = backend.build_metadata(batch, BLOCK_SIZE, num_heads, num_kv_heads, HEAD_DIM, dtype)
    caches = (key_cache.clone(), value_cache.clone())
    expected = backend.forward(query, key, value, *caches, metadata, 0.25)
    out = backend.forward(q_view, k_view, v_view, key_cache, value_cache, metadata, 0.25)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_decode_only_and_single_prefill_batches(backend_name):
    num_heads, num_kv_heads, dtype = 4, 2, torch.float64
    backend = get_attention_backend(backend_name)
    for decodes, prefills in (([(2, 1), (7, 1)], []), ([], [(6, 5)])):
        gen = torch.Generator().manual_seed(1)
        key_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM, dtype=dtype)
        value_cache = torch.zeros_like(key_cache)
        spans, expected, queries = [], [], []
        next_block = 0
        for num_cached, num_new in decodes + prefills:
            context_len = num_cached + num_new
            num_blocks = -(-context_len // BLOCK_SIZE)
            block_ids = list(range(next_block, next_block + num_blocks))[::-1]
            next_block += num_blocks
            keys = torch.randn(context_len, num_kv_heads, HEAD_DIM, generator=gen, dtype=dtype)
            query = torch.randn(num_new, num_heads, HEAD_DIM, generator=gen, dtype=dtype)
            for position in range(context_len):
                key_cache[block_ids[position // BLOCK_SIZE], position % BLOCK_SIZE] = keys[position]
                value_cache[block_ids[position // BLOCK_SIZE], position % BLOCK_SIZE] = keys[position]
            spans.append(SequenceSpan(block_ids, num_cached, num_new))
            queries.append(query)
            expected.append(dense_attention(query, keys, keys, num_cached, 0.5))
        batch = build_attention_batch(spans[: len(decodes)], spans[len(decodes) :], BLOCK_SIZE)
        metadata = backend.build_metadata(batch, BLOCK_SIZE, num_heads, num_kv_heads, HEAD_DIM, dtype)
        new_keys = key_cache.view(-1, num_kv_heads, HEAD_DIM)[batch.slot_mapping].clone()
        out = backend.forward(
            torch.cat(queries), new_keys, new_keys, key_cache, value_cache, metadata, 0.5
        )
        torch.testing.assert_close(out, torch.cat(expected), atol=1e-12, rtol=0)


def test_build_attention_batch_layout():
    batch = build_attention_batch(
        decodes=[SequenceSpan([5, 2], 4, 1)],
        prefills=[SequenceSpan([7], 0, 3), SequenceSpan([1, 3, 0], 6, 4)],
        block_size=BLOCK_SIZE,
    )
    batch.check_integrity(BLOCK_SIZE)
    # decode at position 4 -> block 2 offset 0; prefill 0 positions 0..2 in block 7;
    # prefill 1 positions 6..9 -> block 3 offsets 2, 3 then block 0 offsets 0, 1.
    assert batch.slot_mapping.tolist() == [8, 28, 29, 30, 14, 15, 0, 1]
    # One row per sequence, as wide as the longest needs, padded with 0.
    assert batch.block_tables.tolist() == [[5, 2, 0], [7, 0, 0], [1, 3, 0]]
    assert batch.query_start.tolist() == [0, 1, 4, 8]
    assert batch.seq_lens.tolist() == [5, 3, 10]
    assert (batch.max_query_len, batch.max_seq_len) == (4, 10)
    assert batch.decode_block_tables.tolist() == [[5, 2, 0]]
    assert batch.decode_seq_lens.tolist() == [5] and batch.decode_max_seq_len == 5
    layout = [(c.token_start, c.num_tokens, c.context_len) for c in batch.prefills]
    assert layout == [(1, 3, 3), (4, 4, 10)]
    assert batch.prefills[1].block_ids.tolist() == [1, 3, 0]


@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("num_seqs", [1, 3, 24])
def test_native_decode_kernel_head_sizes_and_threads(head_dim, num_threads, num_seqs):
    """The native decode kernel's vector paths (head_dim multiple of 64, or not),
    one KV head per work item (few sequences) or all of them (many), 1 and 2 threads.
    Checked against the torch backend's decodes in float32."""
    from engine.kernels import paged_decode_attention

    get_attention_backend("cpu")  # builds the kernels
    gen = torch.Generator().manual_seed(head_dim + num_seqs)
    block_size, num_heads, num_kv_heads = 16, 9, 3
    seq_lens = torch.randint(1, 300, (num_seqs,), generator=gen)
    blocks_per_seq = [-(-int(n) // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 4
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(num_seqs, max(blocks_per_seq) + 2, dtype=torch.int64)
    start = 0
    for row, count in enumerate(blocks_per_seq):
        tables[row, :count] = order[start : start + count]
        start += count
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=gen)
    value_cache = torch.randn(cache_shape, generator=gen)
    query = torch.randn(num_seqs, num_heads, head_dim, generator=gen)
    scale = head_dim**-0.5

    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out = torch.full_like(query, float("nan"))
        paged_decode_attention(query, key_cache, value_cache, tables, seq_lens, scale, out)
    finally:
        torch.set_num_threads(previous)

    for row in range(num_seqs):
        n = int(seq_lens[row])
        slots = (tables[row, : blocks_per_seq[row]][:, None] * block_size + torch.arange(block_size)).flatten()[:n]
        keys = key_cache.view(-1, num_kv_heads, head_dim)[slots]
        values = value_cache.view(-1, num_kv_heads, head_dim)[slots]
        expected = dense_attention(query[row : row + 1], keys, values, n - 1, scale)
        torch.testing.assert_close(out[row : row + 1].double(), expected, atol=2e-6, rtol=0)


def test_native_decode_kernel_rejects_bad_layouts():
    from engine.kernels import paged_decode_attention

    get_attention_backend("cpu")
    key_cache = torch.zeros(4, 16, 2, 64)
    query = torch.zeros(2, 4, 64)
    tables = torch.zeros(2, 1, dtype=torch.int64)
    lens = torch.ones(2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="int64"):
        paged_decode_attention(query, key_cache, key_cache, tables.int(), lens, 1.0, torch.empty_like(query))
    with pytest.raises(RuntimeError, match="multiple of num_kv_heads"):
        bad_query = torch.zeros(2, 3, 64)
        paged_decode_attention(bad_query, key_cache, key_cache, tables, lens, 1.0, torch.empty_like(bad_query))
    with pytest.raises(RuntimeError, match="dtype"):
        paged_decode_attention(query.double(), key_cache, key_cache, tables, lens, 1.0, torch.empty_like(query))


def test_auto_backend_is_native_on_cpu():
    assert get_attention_backend("auto").name == "cpu"


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="torch"):
        get_attention_backend("flash")


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_caches_with_overlapping_blocks_are_refused(backend_name):
    """A block stride shorter than a block would alias slots of two blocks: refused, not garbage."""
    batch, _, query, key, value, key_cache, value_cache = make_step(8, 2, torch.float64)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    row = num_kv_heads * head_dim
    overlapping = [c.as_strided(c.shape, ((block_size - 1) * row, row, head_dim, 1)) for c in (key_cache, value_cache)]
    backend = get_attention_backend(backend_name)
    metadata = backend.build_metadata(batch, BLOCK_SIZE, 8, 2, HEAD_DIM, torch.float64)
    with pytest.raises((ValueError, RuntimeError), match="disjoint"):
        backend.forward(query, key, value, *overlapping, metadata, 0.25)


def test_empty_block_major_cache():
    from engine.kv.cache import KVCache, KVLayout

    cache = KVCache(KVLayout(2, 4, 2, 8, torch.float32), 0, 0)
    assert cache.block_rows.shape == (0, 2 * 2 * 4 * 2 * 8)
    assert cache.layers[1][0].shape == (0, 4, 2, 8)


def test_decode_kernel_refuses_overlapping_blocks_and_reads_block_major_caches():
    from engine.kernels import paged_decode_attention

    get_attention_backend("cpu")  # builds the kernels
    batch, sequences, query, key, value, key_cache, value_cache = make_step(
        8, 2, torch.float64, prefills=(), block_major=True
    )
    backend = get_attention_backend("torch")
    metadata = backend.build_metadata(batch, BLOCK_SIZE, 8, 2, HEAD_DIM, torch.float64)
    backend.forward(query, key, value, key_cache, value_cache, metadata, 0.25)  # writes this step's slots
    out = torch.empty_like(query)
    paged_decode_attention(query, key_cache, value_cache, batch.decode_block_tables, batch.decode_seq_lens, 0.25, out)
    assert_matches_reference(out, sequences, 0.25, torch.float64)
    row = key_cache.shape[2] * HEAD_DIM
    overlapping = [c.as_strided(c.shape, ((BLOCK_SIZE - 1) * row, row, HEAD_DIM, 1)) for c in (key_cache, value_cache)]
    with pytest.raises(RuntimeError, match="disjoint"):
        paged_decode_attention(query, *overlapping, batch.decode_block_tables, batch.decode_seq_lens, 0.25, out)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_triton_backend_forward_matches_dense_reference(num_heads, num_kv_heads):
    """The Triton backend's `forward` (q and k rotated by the caller: a torch store, then
    the paged kernel; the model's path is `forward_rotary`, tests/kernels/test_triton_kernels.py)
    on a block-major cache, under the interpreter without a GPU."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch, sequences, query, key, value, key_cache, value_cache = make_step(
        num_heads, num_kv_heads, torch.float32, block_major=True
    )
    blocks = key_cache._base
    others = blocks[:, [0, 2]].clone()
    backend = get_attention_backend("triton", device)
    on_device = {name: getattr(batch, name).to(device)
                 for name in ("slot_mapping", "query_start", "seq_lens", "block_tables")}
    batch = dataclasses.replace(batch, **on_device)
    blocks = blocks.to(device)
    key_cache, value_cache = blocks[:, 1, 0], blocks[:, 1, 1]
    metadata = backend.build_metadata(batch, BLOCK_SIZE, num_heads, num_kv_heads, HEAD_DIM, torch.float32)
    query, key, value = (tensor.to(device) for tensor in (query, key, value))
    out = backend.forward(query, key, value, key_cache, value_cache, metadata, HEAD_DIM**-0.5)

    assert_matches_reference(out.cpu(), sequences, HEAD_DIM**-0.5, torch.float32)
    flat_keys = key_cache.reshape(-1, num_kv_heads, HEAD_DIM).cpu()
    assert torch.equal(flat_keys[batch.slot_mapping.cpu()], key.cpu())
    assert torch.equal(blocks[:, [0, 2]].cpu(), others), "a slot write landed in another layer"

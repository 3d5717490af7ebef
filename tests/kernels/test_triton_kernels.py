"""Triton kernels (engine/kernels/triton_attention.py, triton_ops.py) against plain torch.

Without CUDA they run on CPU tensors under Triton's interpreter, which must be
switched on before the kernel modules are imported (triton.jit reads it then).
The KV cache is block-major over several layers, as the engine's is; the kernels
see one middle layer's views and must leave the other layers' bytes alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from engine.envs import use_triton_interpreter

triton = pytest.importorskip("triton")
if not torch.cuda.is_available():
    use_triton_interpreter()

from engine.kernels.triton_attention import choose_num_splits, paged_attention  # noqa: E402
from engine.kernels.triton_ops import (  # noqa: E402
    add_rms_norm,
    copy_rows,
    rms_norm,
    rope_and_store_kv,
    silu_and_mul,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bfloat16 tl.dot is wrong under the interpreter: bfloat16 only on a GPU.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
NUM_LAYERS, LAYER = 3, 1  # the kernels run on the middle layer of a block-major cache
TABLE_PADDING = 10**9  # a block-table entry past a sequence's blocks: reading it would fault


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """Bitwise view, so that NaN-filled regions compare equal to themselves."""
    return tensor.contiguous().view(torch.uint8)


def make_blocks(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype, gen) -> torch.Tensor:
    """`[num_blocks, NUM_LAYERS, 2, block_size, KvH, Dh]`: other layers NaN, so a read
    of the wrong layer shows in the output."""
    blocks = torch.full((num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim), float("nan"))
    blocks[:, LAYER] = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=gen)
    return blocks.to(dtype).to(DEVICE)


@dataclass
class PagedBatch:
    query: torch.Tensor  # [N, H, Dh]
    blocks: torch.Tensor  # the whole multi-layer cache
    query_start: torch.Tensor  # [B + 1]
    seq_lens: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, max_blocks]
    max_query_len: int
    max_seq_len: int

    @property
    def key_cache(self) -> torch.Tensor:
        return self.blocks[:, LAYER, 0]

    @property
    def value_cache(self) -> torch.Tensor:
        return self.blocks[:, LAYER, 1]


def make_batch(seqs: list[tuple[int, int]], num_kv_heads: int, group: int, head_dim: int, block_size: int,
               dtype, fused_qkv: bool = True, seed: int = 0) -> PagedBatch:
    """`seqs`: (context length after the step, new tokens) per sequence. Blocks are
    scattered at random; slots past a context and blocks nobody owns hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = group * num_kv_heads
    blocks_per_seq = [math.ceil(seq_len / block_size) for seq_len, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    blocks = make_blocks(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen)
    block_ids = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(seqs), max(blocks_per_seq) + 2), TABLE_PADDING, dtype=torch.int64)
    blocks[block_ids[sum(blocks_per_seq):], LAYER] = float("nan")
    used = 0
    for row, ((seq_len, _), count) in enumerate(zip(seqs, blocks_per_seq)):
        block_tables[row, :count] = block_ids[used:used + count]
        used += count
        blocks[block_tables[row, count - 1], LAYER, :, seq_len - (count - 1) * block_size:] = float("nan")
    query_lens = torch.tensor([query_len for _, query_len in seqs])
    num_tokens = int(query_lens.sum())
    if fused_qkv:  # the attention reads q straight out of the projection's output
        qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
        query = qkv.to(dtype).to(DEVICE)[:, :num_heads]
        assert not query.is_contiguous()
    else:
        query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    return PagedBatch(
        query=query,
        blocks=blocks,
        query_start=torch.cat([torch.zeros(1, dtype=torch.int64), query_lens.cumsum(0)]).to(DEVICE),
        seq_lens=torch.tensor([seq_len for seq_len, _ in seqs]).to(DEVICE),
        block_tables=block_tables.to(DEVICE),
        max_query_len=int(query_lens.max()),
        max_seq_len=max(seq_len for seq_len, _ in seqs),
    )


def reference_attention(batch: PagedBatch, scale: float) -> torch.Tensor:
    """Dense causal attention in float64 over each sequence's gathered K/V: [N, H, Dh]."""
    num_heads = batch.query.shape[1]
    block_size, num_kv_heads, head_dim = batch.key_cache.shape[1:]
    out = torch.empty(batch.query.shape, dtype=torch.float64)
    for row, seq_len in enumerate(batch.seq_lens.tolist()):
        begin, end = batch.query_start[row].item(), batch.query_start[row + 1].item()
        block_ids = batch.block_tables[row, :math.ceil(seq_len / block_size)]
        keys, values = (cache[block_ids].reshape(-1, num_kv_heads, head_dim)[:seq_len].double().cpu()
                        .repeat_interleave(num_heads // num_kv_heads, dim=1)  # [S, H, Dh]
                        for cache in (batch.key_cache, batch.value_cache))
        query = batch.query[begin:end].double().cpu()  # [q, H, Dh]
        scores = torch.einsum("qhd,khd->hqk", query, keys) * scale
        positions = seq_len - (end - begin) + torch.arange(end - begin)
        scores.masked_fill_(torch.arange(seq_len)[None, :] > positions[:, None], float("-inf"))
        out[begin:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
    return out


def run_attention(batch: PagedBatch, num_splits: int = 1, tile_n: int | None = None) -> torch.Tensor:
    out = torch.empty(batch.query.shape, dtype=batch.query.dtype, device=DEVICE)
    before = as_bytes(batch.blocks).clone()
    paged_attention(batch.query, batch.key_cache, batch.value_cache, out, batch.query_start, batch.seq_lens,
                    batch.block_tables, batch.query.shape[-1] ** -0.5, batch.max_query_len, batch.max_seq_len,
                    num_splits, tile_n=tile_n)
    assert torch.equal(as_bytes(batch.blocks), before)  # attention only reads the cache
    return out


def assert_matches(out: torch.Tensor, expected: torch.Tensor) -> None:
    tolerance = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.double().cpu(), expected.double().cpu(), atol=tolerance, rtol=tolerance)


# (context length after the step, new tokens) per sequence.
BATCHES = {
    "decode": [(1, 1), (37, 1), (70, 1), (16, 1)],
    "chunks": [(20, 20), (45, 45), (9, 9)],
    "mixed": [(50, 1), (33, 12), (17, 17), (64, 1), (90, 40)],
    "chunk_over_prefix": [(80, 25)],
    # Decodes and chunks interleaved, enough sequences for a deep search over query_start.
    "many_sequences": [(5 + 7 * i, 1) for i in range(6)] + [(30, 3), (12, 12)] + [(40 + i, 1) for i in range(5)],
}
# (KV heads, query heads per KV head, head dim, block size, key tile or None for the default 16)
SHAPES = [
    (2, 1, 64, 16, None),
    (2, 4, 128, 32, None),  # key tile within a block
    (1, 8, 64, 16, 32),  # key tile over two blocks
    (2, 2, 80, 16, None),  # head dim padded to 128
    (1, 4, 128, 16, 64),  # key tile over four blocks, the GPU's default tile
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "kv{}-g{}-d{}-bs{}-tile{}".format(*s))
@pytest.mark.parametrize("kind", list(BATCHES))
def test_paged_attention_matches_dense_reference(kind, shape, dtype):
    num_kv_heads, group, head_dim, block_size, tile_n = shape
    batch = make_batch(BATCHES[kind], num_kv_heads, group, head_dim, block_size, dtype,
                       fused_qkv=kind != "decode")
    out = run_attention(batch, tile_n=tile_n)
    assert out.dtype == dtype
    assert_matches(out, reference_attention(batch, head_dim**-0.5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [2, 3, 4])
def test_split_kv_matches_single_pass(num_splits, dtype):
    # The 20- and 1-key contexts leave splits empty; 150 keys split unevenly.
    batch = make_batch([(20, 1), (150, 1), (1, 1), (97, 1)], num_kv_heads=2, group=4, head_dim=64,
                       block_size=16, dtype=dtype, seed=num_splits)
    single = run_attention(batch, num_splits=1)
    split = run_attention(batch, num_splits=num_splits)
    assert_matches(split, single)
    assert_matches(split, reference_attention(batch, 64**-0.5))


@pytest.mark.parametrize("num_splits", [1, 3])
def test_table_stride_read_from_memory(num_splits):
    """A static batch's launch (engine/runner/decode_graphs.py) reads the block tables' row stride
    from a device tensor: tables written at their own width W behind a view of any other
    width give the plain launch's output, split or not."""
    batch = make_batch([(20, 1), (150, 1), (1, 1), (97, 1)], num_kv_heads=2, group=4, head_dim=64,
                       block_size=16, dtype=torch.float32, seed=7)
    plain = run_attention(batch, num_splits=num_splits)
    tables = batch.block_tables.contiguous()
    num_seqs, width = tables.shape
    buffer = torch.full((num_seqs * (width + 8),), TABLE_PADDING, dtype=torch.int64, device=DEVICE)
    buffer[: num_seqs * width] = tables.reshape(-1)
    wider_view = buffer.view(num_seqs, width + 8)  # rows really start every `width` entries
    out = torch.empty_like(plain)
    paged_attention(batch.query, batch.key_cache, batch.value_cache, out, batch.query_start, batch.seq_lens,
                    wider_view, 64**-0.5, 1, batch.max_seq_len, num_splits,
                    table_stride=torch.tensor([width], device=DEVICE))
    assert torch.equal(out, plain)


def test_split_kv_is_for_decode_only_batches():
    batch = make_batch([(20, 2)], num_kv_heads=1, group=1, head_dim=64, block_size=16, dtype=torch.float32)
    with pytest.raises(ValueError, match="decode-only"):
        run_attention(batch, num_splits=2)


def test_choose_num_splits():
    assert choose_num_splits(num_seqs=64, num_kv_heads=8, max_seq_len=8192, num_sms=132) == 1  # GPU full
    assert choose_num_splits(num_seqs=2, num_kv_heads=8, max_seq_len=100, num_sms=132) == 1  # short contexts
    assert choose_num_splits(num_seqs=2, num_kv_heads=8, max_seq_len=512, num_sms=132) == 8  # >= 64 keys each
    assert choose_num_splits(num_seqs=2, num_kv_heads=8, max_seq_len=8192, num_sms=132) == 17  # 2 programs/SM
    assert choose_num_splits(num_seqs=1, num_kv_heads=1, max_seq_len=256, num_sms=132) == 4  # >= 64 keys each
    assert choose_num_splits(num_seqs=1, num_kv_heads=1, max_seq_len=1 << 20, num_sms=132) == 32  # the cap


# ------------------------------------------------------------------ RoPE + KV store
def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotate-half RoPE on [N, heads, Dh], in float32, rounded once."""
    x32, cos32, sin32 = x.float(), cos.float()[:, None], sin.float()[:, None]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos32 + rotated * sin32).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size",
                         [(4, 2, 64, 16), (8, 1, 128, 32), (6, 2, 80, 16), (4, 4, 96, 16)])
def test_rope_and_store_kv(num_heads, num_kv_heads, head_dim, block_size, dtype):
    gen = torch.Generator().manual_seed(head_dim)
    num_tokens, num_blocks = 11, 5
    width = (num_heads + 2 * num_kv_heads) * head_dim
    # Rows 24 elements longer than the heads: qkv's row stride is not its width.
    storage = torch.randn(num_tokens, width + 24, generator=gen).to(dtype).to(DEVICE)
    qkv = storage[:, :width].view(num_tokens, num_heads + 2 * num_kv_heads, head_dim)
    angles = torch.rand(num_tokens, head_dim // 2, generator=gen) * 40
    freqs = torch.cat([angles, angles], dim=-1)
    cos, sin = freqs.cos().to(dtype).to(DEVICE), freqs.sin().to(dtype).to(DEVICE)
    blocks = make_blocks(num_blocks, block_size, num_kv_heads, head_dim, dtype, gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # rotated, not stored
    storage_before, blocks_before = storage.clone(), blocks.clone()
    rotated_before = num_heads + num_kv_heads

    rope_and_store_kv(qkv, cos, sin, blocks[:, LAYER, 0], blocks[:, LAYER, 1], slots.to(DEVICE),
                      num_heads, num_kv_heads)

    expected = reference_rope(storage_before[:, :width].view_as(qkv)[:, :rotated_before], cos, sin)
    tolerance = TOLERANCE[dtype] / 2
    torch.testing.assert_close(qkv[:, :rotated_before], expected, atol=tolerance, rtol=tolerance)
    assert torch.equal(as_bytes(qkv[:, rotated_before:]),
                       as_bytes(storage_before[:, :width].view_as(qkv)[:, rotated_before:]))  # v untouched
    assert torch.equal(as_bytes(storage[:, width:]), as_bytes(storage_before[:, width:]))
    # The cache: exactly the rotated k and the v at each stored slot, every other byte as before.
    expected_blocks = blocks_before.clone()
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_blocks[slot // block_size, LAYER, 0, slot % block_size] = qkv[token, num_heads:rotated_before]
            expected_blocks[slot // block_size, LAYER, 1, slot % block_size] = qkv[token, rotated_before:]
    assert torch.equal(as_bytes(blocks), as_bytes(expected_blocks))


# ------------------------------------------------------------------ RMSNorm
def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: normalise in float32, cast back, times the weight."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 4096])
def test_add_rms_norm(hidden, dtype):
    gen = torch.Generator().manual_seed(hidden)
    x, residual = ((torch.randn(7, hidden, generator=gen) * 3).to(dtype).to(DEVICE) for _ in range(2))
    weight = torch.randn(hidden, generator=gen).to(dtype).to(DEVICE)
    expected_residual = x + residual
    expected = reference_rms_norm(expected_residual, weight, 1e-5)
    out = add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, expected_residual)  # one rounding, as torch's add
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 8192])
def test_rms_norm(hidden, dtype):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(5, hidden, generator=gen) * 3).to(dtype).to(DEVICE)
    weight = torch.randn(hidden, generator=gen).to(dtype).to(DEVICE)
    before = x.clone()
    out = rms_norm(x, weight, 1e-6)
    assert torch.equal(x, before)
    torch.testing.assert_close(out, reference_rms_norm(x, weight, 1e-6), atol=TOLERANCE[dtype],
                               rtol=TOLERANCE[dtype])


def test_rms_norm_promotes_like_torch():
    """A float32 weight on float16 activations gives float32, as `weight * normed` does."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 576, generator=gen).half().to(DEVICE)
    weight = torch.randn(576, generator=gen).to(DEVICE)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference_rms_norm(x, weight, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [96, 1536])
def test_silu_and_mul(inter, dtype):
    """As the model's torch formula, F.silu(gate) * up, each op rounded to the dtype."""
    gen = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(5, 2 * inter, generator=gen) * 4).to(dtype).to(DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    out = silu_and_mul(gate_up)
    assert out.shape == (5, inter) and out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert silu_and_mul(gate_up[:0]).shape == (0, inter)


@pytest.mark.parametrize("row_len", [48, 5000])
def test_copy_rows_moves_exactly_the_listed_rows(row_len):
    """Rows land at their destinations bit for bit; every other destination row is untouched."""
    gen = torch.Generator().manual_seed(row_len)
    src = torch.randint(-(2**62), 2**62, (40, row_len), generator=gen, dtype=torch.int64).to(DEVICE)
    dst = torch.randint(-(2**62), 2**62, (50, row_len), generator=gen, dtype=torch.int64).to(DEVICE)
    src_ids = torch.randperm(40, generator=gen)[:17]
    dst_ids = torch.randperm(50, generator=gen)[:17]
    expected = dst.clone()
    expected[dst_ids.to(DEVICE)] = src[src_ids.to(DEVICE)]
    copy_rows(src, dst, src_ids.to(DEVICE), dst_ids.to(DEVICE))
    assert torch.equal(dst, expected)
    before = dst.clone()
    copy_rows(src, dst, src_ids[:0].to(DEVICE), dst_ids[:0].to(DEVICE))
    assert torch.equal(dst, before)

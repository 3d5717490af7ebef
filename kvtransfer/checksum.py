"""Per-block checksums of a KV cache, computed where the cache lives (CPU or GPU)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

from engine.kv.cache import KVCache

# Integer view of each element size: the checksum reads raw bits, never float values,
# so -0.0 vs 0.0 and NaN payloads count as different data.
_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

_WEIGHT_SEED = 0x6B76_7472  # "kvtr"
_MASK_64 = (1 << 64) - 1

# splitmix64's finalizer constants, as the signed int64 values torch needs.
_MIX_1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX_2 = 0x94D049BB133111EB - (1 << 64)


def block_checksums(kv_cache: KVCache, block_ids: Sequence[int]) -> list[int]:
    """One unsigned 64-bit checksum per block in `block_ids`, over every layer's K and V bits.

    checksum(block) = sum over positions p of weight[p] * mix(bits[p])  (mod 2**64)

    where p runs over (layer, K/V, element within the block), `bits` is the element
    widened to int64, `mix` is splitmix64's bijective finalizer and the weights are
    fixed pseudo-random odd numbers. Because mix is a bijection and the weights are
    odd, changing any single element (one flipped bit, say) always changes the sum.
    Swapping two positions changes it by (w_i - w_j) * (mix_j - mix_i); mixing makes
    that vanish mod 2**64 only with chance about 2**-62 (without it, a swap of two
    float64 values whose bits differ only at bit 62 would slip through half the time).
    Swapped blocks show up as swapped entries of the returned list.
    """
    layers = kv_cache.layers
    if not block_ids:
        return []
    device = layers[0][0].device
    num_blocks = layers[0][0].shape[0]
    ids = torch.tensor(list(block_ids), dtype=torch.long)
    if int(ids.min()) < 0 or int(ids.max()) >= num_blocks:
        raise IndexError(f"block id out of range 0..{num_blocks - 1}: {list(block_ids)}")
    ids = ids.to(device)
    int_dtype = _INT_VIEW[layers[0][0].element_size()]
    block_numel = layers[0][0][0].numel()
    weights = _weights(2 * len(layers) * block_numel, device)  # [layers * 2 * block_numel]
    total = torch.zeros(len(block_ids), dtype=torch.int64, device=device)  # [n]
    for layer_index, (keys, values) in enumerate(layers):
        for kv_index, cache in enumerate((keys, values)):
            offset = (2 * layer_index + kv_index) * block_numel
            rows = cache.view(num_blocks, block_numel).view(int_dtype)  # [num_blocks, block_numel]
            bits = rows.index_select(0, ids).to(torch.int64)  # [n, block_numel]
            total += (_mix(bits) * weights[offset : offset + block_numel]).sum(dim=1)
    return [value & _MASK_64 for value in total.tolist()]


@lru_cache(maxsize=16)
def _weights(num_positions: int, device: torch.device) -> torch.Tensor:
    """Odd int64 weights, one per position; the same on every process for a given size."""
    generator = torch.Generator().manual_seed(_WEIGHT_SEED)
    weights = torch.randint(-(2**63), 2**63 - 1, (num_positions,), dtype=torch.int64, generator=generator)
    return (weights | 1).to(device)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (wrapping multiplies, logical right shifts); a bijection."""
    x = x ^ _shift_right_logical(x, 30)
    x = x * _MIX_1
    x = x ^ _shift_right_logical(x, 27)
    x = x * _MIX_2
    return x ^ _shift_right_logical(x, 31)


def _shift_right_logical(x: torch.Tensor, bits: int) -> torch.Tensor:
    # torch's >> on int64 is arithmetic (copies the sign bit); mask those copies away.
    return (x >> bits) & ((1 << (64 - bits)) - 1)

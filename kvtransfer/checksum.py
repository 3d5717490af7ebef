"""Per-block checksums of KV blocks, computed with torch ops (on the cache's device)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch

from engine.kv_cache import KVCache

_INT_VIEW = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@lru_cache(maxsize=16)
def _weights(num_elements: int, device: str) -> torch.Tensor:
    """Fixed pseudo-random odd int64 weights, one per element position in a block."""
    generator = torch.Generator().manual_seed(0x5EED_BA70)
    weights = torch.randint(-(2**62), 2**62, (num_elements,), generator=generator, dtype=torch.int64)
    return (weights * 2 + 1).to(device)  # odd: every bit of every element reaches the sum


def block_checksums(kv_cache: KVCache, block_ids: Sequence[int]) -> list[int]:
    """One 64-bit checksum per block over every layer's keys and values.

    Each element's bits, read as an integer, are multiplied by a weight that
    depends on its position in the block, and summed with wraparound; each
    layer and K/V half is rotated in by a further multiply. A flipped bit, two
    swapped positions or two swapped blocks change the sum.
    """
    if not block_ids:
        return []
    first = kv_cache.layers[0][0]
    device = first.device
    index = torch.as_tensor(list(block_ids), dtype=torch.long, device=device)
    int_dtype = _INT_VIEW[first.element_size()]
    num_elements = first[0].numel()
    weights = _weights(num_elements, str(device))
    total = torch.zeros(len(block_ids), dtype=torch.int64, device=device)
    for keys, values in kv_cache.layers:
        for half in (keys, values):
            bits = half.index_select(0, index).view(int_dtype).reshape(len(block_ids), -1)
            part = (bits.to(torch.int64) * weights).sum(dim=1)  # [n]
            # Mix before adding the next part so equal parts in two places do not cancel.
            total = total * 0x100000001B3 + part
    return [int(value) for value in total.tolist()]

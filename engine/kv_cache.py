"""The KV tensors: per-layer device caches and the CPU-side swap pool."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.block_pool import BlockCopy


@dataclass(frozen=True)
class KVLayout:
    """Shape of one layer's cache block; the same on every side that exchanges KV."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, keys and values."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size


class KVCache:
    """Device caches `[num_blocks, block_size, num_kv_heads, head_dim]` per layer (keys, values),
    and a swap pool of the same layout in CPU memory for swap preemption.

    Zero-filled: attention reads whole blocks and masks the unused slots, so
    those slots must hold finite values.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        num_swap_blocks: int,
        device: torch.device | str = "cpu",
    ) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.num_swap_blocks = num_swap_blocks
        shape = (num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        swap_shape = (num_swap_blocks, *shape[1:])
        pin = torch.device(device).type == "cuda"
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                torch.zeros(shape, dtype=layout.dtype, device=device),
                torch.zeros(shape, dtype=layout.dtype, device=device),
            )
            for _ in range(layout.num_layers)
        ]
        self.swap_layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (
                torch.zeros(swap_shape, dtype=layout.dtype, pin_memory=pin),
                torch.zeros(swap_shape, dtype=layout.dtype, pin_memory=pin),
            )
            for _ in range(layout.num_layers if num_swap_blocks else 0)
        ]

    def swap_out(self, copies: list[BlockCopy]) -> int:
        """Copy device blocks to swap blocks; returns bytes moved."""
        return self._copy(copies, self.layers, self.swap_layers)

    def swap_in(self, copies: list[BlockCopy]) -> int:
        """Copy swap blocks back to device blocks; returns bytes moved."""
        return self._copy(copies, self.swap_layers, self.layers)

    def _copy(self, copies, sources, destinations) -> int:
        if not copies:
            return 0
        device = self.layers[0][0].device
        src = torch.tensor([c.src for c in copies], dtype=torch.long)
        dst = torch.tensor([c.dst for c in copies], dtype=torch.long)
        for (src_k, src_v), (dst_k, dst_v) in zip(sources, destinations):
            src_idx = src.to(src_k.device)
            dst_idx = dst.to(dst_k.device)
            dst_k.index_copy_(0, dst_idx, src_k.index_select(0, src_idx).to(dst_k.device))
            dst_v.index_copy_(0, dst_idx, src_v.index_select(0, src_idx).to(dst_v.device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return len(copies) * self.layout.bytes_per_block

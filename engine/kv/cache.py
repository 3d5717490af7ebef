"""The KV tensors: per-layer device caches and the CPU-side swap pool."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kv.block_pool import BlockCopy
from engine.kv.shared_memory import SharedMemory


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
    """The paged KV cache of every layer, block-major, and a swap pool of the same
    layout in CPU memory for swap preemption.

    One tensor holds the device blocks, `[num_blocks, num_layers, 2 (K/V), block_size,
    num_kv_heads, head_dim]`, so each block is one contiguous row of
    `layout.bytes_per_block` bytes across all layers: a KV handoff or a swap moves a
    block as one piece, straight from or into the cache. Attention sees each layer
    through `layers[l] = (keys, values)`, views `[num_blocks, block_size, KvH, Dh]`
    whose block dimension is strided (`stride(0)` is the whole block row; the other
    three dimensions are contiguous).

    Zero-filled: attention reads whole blocks and masks the unused slots, so
    those slots must hold finite values.

    On CUDA the swap pool is pinned and swaps are asynchronous copies on the
    compute stream: the host never waits for them, and stream order keeps them
    between the forward passes that read and write the same blocks. Nothing
    reads the swap pool on the host.

    `shareable`: another process on this host may map the device blocks and write
    into them (kvtransfer's ipc transport). On CPU they then live in a memfd segment
    (`shared_memory`, engine/kv/shared_memory.py); a CUDA allocation is shareable as it
    is, through CUDA IPC handles.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        num_swap_blocks: int,
        device: torch.device | str = "cpu",
        *,
        shareable: bool = False,
    ) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.num_swap_blocks = num_swap_blocks
        pin = torch.device(device).type == "cuda"
        self.shared_memory: SharedMemory | None = None
        if shareable and torch.device(device).type == "cpu":
            self.shared_memory = SharedMemory(num_blocks * layout.bytes_per_block, "baton-kv-cache")
            self.blocks = self.shared_memory.tensor(layout.dtype).view(self._shape(num_blocks))  # zero-filled
        else:
            self.blocks = torch.zeros(self._shape(num_blocks), dtype=layout.dtype, device=device)
        self.swap_blocks = torch.zeros(self._shape(num_swap_blocks), dtype=layout.dtype, pin_memory=pin)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = self._layer_views(self.blocks)

    @property
    def block_rows(self) -> torch.Tensor:
        """`[num_blocks, block_numel]`: block b's K and V of every layer as one contiguous row."""
        return self.blocks.view(self.num_blocks, self.layout.bytes_per_block // self.blocks.element_size())

    def _shape(self, num_blocks: int) -> tuple[int, ...]:
        layout = self.layout
        return (num_blocks, layout.num_layers, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)

    def _layer_views(self, blocks: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(blocks[:, layer, 0], blocks[:, layer, 1]) for layer in range(self.layout.num_layers)]

    def swap_out(self, copies: list[BlockCopy]) -> int:
        """Copy device blocks to swap blocks; returns bytes moved."""
        return self._copy(copies, self.blocks, self.swap_blocks)

    def swap_in(self, copies: list[BlockCopy]) -> int:
        """Copy swap blocks back to device blocks; returns bytes moved."""
        return self._copy(copies, self.swap_blocks, self.blocks)

    def _copy(self, copies, source: torch.Tensor, destination: torch.Tensor) -> int:
        if not copies:
            return 0
        row = self.layout.bytes_per_block // source.element_size()
        source_rows = source.view(source.shape[0], row)
        destination_rows = destination.view(destination.shape[0], row)
        if source.device == destination.device:
            # Whole blocks (all layers at once) as rows: one gather and one scatter per swap.
            src = torch.tensor([c.src for c in copies], dtype=torch.long)
            dst = torch.tensor([c.dst for c in copies], dtype=torch.long)
            destination_rows.index_copy_(0, dst, source_rows.index_select(0, src))
        else:
            # Device <-> pinned host: one asynchronous copy per block row (a row is
            # megabytes on a real model, so per-copy overhead is small).
            for copy in copies:
                destination_rows[copy.dst].copy_(source_rows[copy.src], non_blocking=True)
        return len(copies) * self.layout.bytes_per_block

"""The block layout both sides of a KV handoff must share, and the check of it."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from engine.kv_cache import KVLayout


class KvLayoutMismatchError(ValueError):
    """The two caches of a handoff lay blocks out differently: moving bytes would be garbage."""


@dataclass(frozen=True)
class KvLayoutSpec:
    """Shape and element type of one KV block (all layers, keys and values)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name: "float32", "bfloat16", "float64"

    @classmethod
    def from_kv_layout(cls, layout: KVLayout) -> KvLayoutSpec:
        return cls(
            num_layers=layout.num_layers,
            block_size=layout.block_size,
            num_kv_heads=layout.num_kv_heads,
            head_dim=layout.head_dim,
            dtype=str(layout.dtype).removeprefix("torch."),
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise KvLayoutMismatchError(f"unknown KV dtype {self.dtype!r}")
        return dtype

    @property
    def bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def check_matches(self, other: KvLayoutSpec) -> None:
        """Raise KvLayoutMismatchError naming every field that differs."""
        diffs = [
            f"{f.name} {getattr(self, f.name)} != {getattr(other, f.name)}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]
        if diffs:
            raise KvLayoutMismatchError("KV layout mismatch: " + ", ".join(diffs))

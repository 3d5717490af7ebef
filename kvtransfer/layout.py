"""The KV cache layout that both ends of a transfer must share, in a wire-friendly form."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from engine.config import DTYPES

if TYPE_CHECKING:
    import torch

    from engine.kv.cache import KVLayout


class KvLayoutMismatchError(ValueError):
    """Two KV layouts that must agree (sender and receiver) do not."""


@dataclass(frozen=True)
class KvLayoutSpec:
    """Shape of one block in every layer, with the dtype as its torch name ("bfloat16").

    The same facts as `engine.kv.cache.KVLayout`, but plain ints and a string so
    the spec can cross a process boundary (control-plane message, transfer header).
    """

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        # A spec that no cache can have is a mismatch with every cache (and so callers that
        # turn mismatches into a precondition failure handle a malformed peer spec too).
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise KvLayoutMismatchError(
                    f"invalid KV layout: {name} must be a positive int, got {value!r}"
                )
        # Names, not a look-up in torch: the gateway reads KV handles and must not import
        # torch for it (a second's stall of its event loop, and ~170 MB, at its first handoff).
        if self.dtype not in DTYPES:
            raise KvLayoutMismatchError(f"invalid KV layout: unknown dtype {self.dtype!r}")

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
        import torch

        return getattr(torch, self.dtype)

    @property
    def element_size(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def block_numel(self) -> int:
        """Elements of one block of one layer's keys (or values)."""
        return self.block_size * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, keys and values."""
        return 2 * self.num_layers * self.block_numel * self.element_size

    def check_matches(self, other: KvLayoutSpec) -> None:
        """Raise KvLayoutMismatchError naming every field where `other` differs (ours first)."""
        differences = [
            f"{field.name} {getattr(self, field.name)} != {getattr(other, field.name)}"
            for field in fields(self)
            if getattr(self, field.name) != getattr(other, field.name)
        ]
        if differences:
            raise KvLayoutMismatchError("KV layout mismatch: " + ", ".join(differences))

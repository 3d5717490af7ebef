"""What one block transfer looks like on the wire: its messages, their tags, its header.

Both sides derive the same message plan from (layout, number of blocks, the
channel's message_bytes), so only the header travels besides the data:

    index 0        header: magic+version, the sender's layout, block count, tag
    index 1..N     data: layers [l0, l1) of block positions [b0, b1) of block_ids,
                   [l1 - l0, K/V, b1 - b0, block_size * num_kv_heads * head_dim]

NOTE: no data message is larger than message_bytes (both sides of a channel agree on
it when they connect). Over Gloo the receiver posts every receive with a whole slot
of message_bytes (the header: HEADER_CAPACITY words): Gloo kills the process when a
message is larger than the receive posted for it but accepts a smaller one, so data
receives can go out before the header is checked, and a sender with another layout
still only causes a clean error.

Tag scheme: caller tags wrap at 2**20 (TAG_BITS); message `index` of transfer `tag`
travels under ((tag mod 2**20) << 11) | index, which stays below 2**31, so a
transfer has at most 2**11 - 1 data messages. Because tags wrap, the header
carries the full tag and the receiver checks it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtransfer.layout import KvLayoutSpec

TAG_BITS = 20
INDEX_BITS = 11
MAX_DATA_MESSAGES = (1 << INDEX_BITS) - 1

HEADER_LEN = 16  # int64 words sent
HEADER_CAPACITY = 64  # int64 words received: room for a longer header of a later version
_MAGIC = 0x4B56_5452_0001  # "KVTR", protocol version 1
_NUM_FIELDS = 8
_DTYPE_BYTES = 8 * (HEADER_LEN - _NUM_FIELDS)  # the dtype name, NUL-padded, fills the rest


def wire_tag(tag: int, index: int) -> int:
    """The torch.distributed tag of message `index` (0: header) of transfer `tag`."""
    assert 0 <= index <= MAX_DATA_MESSAGES
    return ((tag % (1 << TAG_BITS)) << INDEX_BITS) | index


@dataclass(frozen=True, slots=True)
class Message:
    """One data message: layers [layer_start, layer_stop) x positions [block_start, block_stop)."""

    layer_start: int
    layer_stop: int
    block_start: int
    block_stop: int

    def shape(self, spec: KvLayoutSpec) -> tuple[int, int, int, int]:
        return (self.layer_stop - self.layer_start, 2, self.block_stop - self.block_start, spec.block_numel)

    def numel(self, spec: KvLayoutSpec) -> int:
        num_layers, num_blocks = self.layer_stop - self.layer_start, self.block_stop - self.block_start
        return 2 * num_layers * num_blocks * spec.block_numel


def plan_messages(spec: KvLayoutSpec, num_blocks: int, message_bytes: int) -> list[Message]:
    """Split a transfer into messages of at most `message_bytes` each.

    Whole layers (all blocks) share a message while they fit; a layer bigger than a
    message is split into runs of blocks. Splits are balanced, so there is no runt.
    ValueError if one block of one layer (K and V) exceeds `message_bytes`, or the
    transfer needs more than MAX_DATA_MESSAGES messages.
    """
    if num_blocks == 0:
        return []
    block_bytes = 2 * spec.block_numel * spec.element_size  # one block of one layer, K and V
    if block_bytes > message_bytes:
        raise ValueError(f"one block of one layer is {block_bytes} bytes, over message_bytes={message_bytes}")
    layer_bytes = num_blocks * block_bytes
    if layer_bytes <= message_bytes:
        layer_runs = _balanced(spec.num_layers, -(-spec.num_layers // (message_bytes // layer_bytes)))
        block_runs = [(0, num_blocks)]
    else:
        layer_runs = _balanced(spec.num_layers, spec.num_layers)
        block_runs = _balanced(num_blocks, -(-num_blocks // (message_bytes // block_bytes)))
    if len(layer_runs) * len(block_runs) > MAX_DATA_MESSAGES:
        raise ValueError(f"{num_blocks} blocks need more than {MAX_DATA_MESSAGES} messages of "
                         f"{message_bytes} bytes: send them in parts, or use larger messages")
    return [Message(l0, l1, b0, b1) for l0, l1 in layer_runs for b0, b1 in block_runs]


def _balanced(total: int, parts: int) -> list[tuple[int, int]]:
    """[start, stop) runs splitting range(total) into `parts` runs whose lengths differ by at most one."""
    parts = max(1, min(parts, total))
    size, extra = divmod(total, parts)
    runs, start = [], 0
    for part in range(parts):
        stop = start + size + (part < extra)
        runs.append((start, stop))
        start = stop
    return runs


@dataclass(frozen=True, slots=True)
class TransferHeader:
    """The sender's description of a transfer, checked by the receiver before any data."""

    spec: KvLayoutSpec
    num_blocks: int
    tag: int

    def encode(self) -> torch.Tensor:
        """[HEADER_LEN] int64 on the CPU."""
        name = self.spec.dtype.encode("ascii")
        if len(name) > _DTYPE_BYTES:
            raise ValueError(f"dtype name too long for the header: {self.spec.dtype}")
        spec = self.spec
        fields = [_MAGIC, spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim,
                  self.num_blocks, self.tag, 0]
        name_words = torch.frombuffer(bytearray(name.ljust(_DTYPE_BYTES, b"\0")), dtype=torch.int64)
        return torch.cat([torch.tensor(fields, dtype=torch.int64), name_words])

    @classmethod
    def decode(cls, words: torch.Tensor) -> TransferHeader:
        """Inverse of encode (`words` may be longer). ValueError if it is not a header of
        this version (or names an unknown dtype)."""
        words = words[:HEADER_LEN].cpu()
        fields = words[:_NUM_FIELDS].tolist()
        magic, num_layers, block_size, num_kv_heads, head_dim, num_blocks, tag, _ = fields
        if magic != _MAGIC:
            raise ValueError(f"not a KV transfer header of this version (magic {magic:#x})")
        dtype = words[_NUM_FIELDS:].numpy().tobytes().rstrip(b"\0").decode("ascii", "replace")
        return cls(KvLayoutSpec(num_layers, block_size, num_kv_heads, head_dim, dtype), num_blocks, tag)

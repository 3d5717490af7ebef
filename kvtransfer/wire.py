"""What one block transfer looks like on the wire: its messages, their tags, its header.

The KV cache is block-major (engine.kv.cache.KVCache): block b's keys and values of
every layer are one contiguous row of the cache. A transfer moves sender block
src_ids[i] into receiver block dst_ids[i], and both sides know both lists (the
control plane exchanged them), so both derive the same message plan and only the
header travels besides the data:

    index 0        header: magic+version, the sender's layout, block count, tag,
                   a digest of (src_ids, dst_ids)
    index 1..N     data (below)

A run is a stretch of positions over which both id lists go up by one: one
contiguous piece of both caches. A run of at least MIN_RUN_BYTES is sent from and
received into the caches in place (no copy on either side), in messages of at most
message_bytes; scattered ids with large blocks make one-block messages, which Gloo
and NCCL keep in flight many at a time (kvtransfer/bench.py measures it). Shorter
runs (small blocks at scattered ids) are gathered into a staging buffer, sent
message_bytes at a time, and scattered on the other side.

    index 1..R        the runs, in order
    index R+1..R+S    the staged messages

NOTE: the receiver posts its data receives only after the header checked out: a
receive lands straight in the cache, and over Gloo a message larger than the receive
posted for it kills the process. The header receive itself is posted with
HEADER_CAPACITY words (Gloo accepts a smaller message), so a peer of another
protocol version still only causes a clean error.

Tag scheme: caller tags wrap at 2**16 (TAG_BITS); message `index` of transfer `tag`
travels under ((tag mod 2**16) << 15) | index, which stays below 2**31, so a
transfer has at most 2**15 - 1 data messages. Because tags wrap, the header
carries the full tag and the receiver checks it.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtransfer.layout import KvLayoutSpec

TAG_BITS = 16
INDEX_BITS = 15
MAX_DATA_MESSAGES = (1 << INDEX_BITS) - 1

# Shortest run of blocks sent in place; shorter ones are staged. Chosen with
# kvtransfer/bench.py over loopback Gloo (figures in docs/kv-transfer.md): from this
# size on, messages go at least as fast as one raw message of all the bytes; smaller
# ones go slower the smaller they are.
MIN_RUN_BYTES = 256 << 10

HEADER_LEN = 16  # int64 words sent
HEADER_CAPACITY = 64  # int64 words received: room for a longer header of a later version
_MAGIC = 0x4B56_5452_0002  # "KVTR", protocol version 2 (block-major caches, runs sent in place)
_NUM_FIELDS = 8
_DTYPE_BYTES = 8 * (HEADER_LEN - _NUM_FIELDS)  # the dtype name, NUL-padded, fills the rest


def wire_tag(tag: int, index: int) -> int:
    """The torch.distributed tag of message `index` (0: header) of transfer `tag`."""
    assert 0 <= index <= MAX_DATA_MESSAGES
    return ((tag % (1 << TAG_BITS)) << INDEX_BITS) | index


@dataclass(frozen=True, slots=True)
class Message:
    """A run of positions [start, stop) of the id lists, contiguous in both caches."""

    start: int
    stop: int

    @property
    def num_blocks(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """A transfer's data messages, in tag order: first the runs sent in place, then the
    staged messages, each carrying `staged_per_message` of the staged positions (the
    last one the rest). Staged blocks are gathered into a staging buffer by the
    sender and scattered from one by the receiver."""

    runs: tuple[Message, ...]
    staged: tuple[int, ...]  # positions too short a run to send in place, in order
    staged_per_message: int

    @property
    def num_staged_messages(self) -> int:
        return -(-len(self.staged) // self.staged_per_message) if self.staged else 0

    @property
    def num_messages(self) -> int:
        return len(self.runs) + self.num_staged_messages

    def staged_slices(self) -> list[tuple[int, int]]:
        """[begin, end) into `staged` of each staged message."""
        per, total = self.staged_per_message, len(self.staged)
        return [(begin, min(begin + per, total)) for begin in range(0, total, per)]


def plan_messages(
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
    bytes_per_block: int,
    message_bytes: int,
    min_run_bytes: int = MIN_RUN_BYTES,
) -> TransferPlan:
    """Split a transfer of src_ids[i] -> dst_ids[i] into messages.

    A run is a maximal stretch of positions where both lists go up by one: it is one
    contiguous piece of both caches. A run of at least `min_run_bytes` goes in place,
    cut into messages of at most max(1, message_bytes // bytes_per_block) blocks
    (balanced cuts, no runt; a block larger than message_bytes travels alone).
    Shorter runs (small blocks at scattered ids) would make many tiny messages:
    their blocks are staged instead, packed message_bytes to a message. ValueError if
    the lists differ in length or the plan needs more than MAX_DATA_MESSAGES messages.
    """
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} sender blocks for {len(dst_ids)} receiver blocks")
    per_message = max(1, message_bytes // bytes_per_block)
    runs: list[Message] = []
    staged: list[int] = []
    start = 0
    for position in range(1, len(src_ids) + 1):
        if (position < len(src_ids) and src_ids[position] == src_ids[position - 1] + 1
                and dst_ids[position] == dst_ids[position - 1] + 1):
            continue
        run = position - start
        if run * bytes_per_block < min_run_bytes:
            staged.extend(range(start, position))
            start = position
            continue
        parts = -(-run // per_message)
        size, extra = divmod(run, parts)
        for part in range(parts):
            stop = start + size + (part < extra)
            runs.append(Message(start, stop))
            start = stop
    plan = TransferPlan(tuple(runs), tuple(staged), per_message)
    if plan.num_messages > MAX_DATA_MESSAGES:
        raise ValueError(f"{len(src_ids)} blocks need {plan.num_messages} messages, more than "
                         f"{MAX_DATA_MESSAGES}: send them in parts")
    return plan


@dataclass(frozen=True, slots=True)
class PreparedTransfer:
    """A transfer checked on one side before anything moves: the layout of this side's
    cache, the message plan, the digest of both id lists, and the lists as ints."""

    spec: KvLayoutSpec
    plan: TransferPlan
    digest: int
    src_ids: list[int]
    dst_ids: list[int]


def prepare_transfer(
    kv_cache,
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
    tag: int,
    *,
    is_sender: bool,
    message_bytes: int,
    min_run_bytes: int = MIN_RUN_BYTES,
) -> PreparedTransfer:
    """Check a transfer's arguments on one side (this side's ids against `kv_cache`, an
    engine.kv.cache.KVCache) and plan it. ValueError on a bad tag, an id out of range,
    two blocks landing in one, or a plan too long."""
    if not isinstance(tag, int) or tag < 0:
        raise ValueError(f"tag must be a non-negative int, got {tag!r}")
    src_ids, dst_ids = [int(i) for i in src_ids], [int(i) for i in dst_ids]
    mine = src_ids if is_sender else dst_ids
    if any(not 0 <= i < kv_cache.num_blocks for i in mine):
        raise ValueError(f"block id out of range 0..{kv_cache.num_blocks - 1}")
    if any(i < 0 for i in src_ids + dst_ids):
        raise ValueError("block ids must be non-negative")
    if len(set(dst_ids)) != len(dst_ids):
        raise ValueError("duplicate receiver block ids: two blocks would land in one")
    spec = KvLayoutSpec.from_kv_layout(kv_cache.layout)
    plan = plan_messages(src_ids, dst_ids, spec.bytes_per_block, message_bytes, min_run_bytes)
    return PreparedTransfer(spec, plan, plan_digest(src_ids, dst_ids), src_ids, dst_ids)


def plan_digest(src_ids: Sequence[int], dst_ids: Sequence[int]) -> int:
    """A 63-bit digest of both id lists: equal on both sides iff they planned the same transfer."""
    data = torch.tensor([len(src_ids), *src_ids, *dst_ids], dtype=torch.int64).numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


@dataclass(frozen=True, slots=True)
class TransferHeader:
    """The sender's description of a transfer, checked by the receiver before any data."""

    spec: KvLayoutSpec
    num_blocks: int
    tag: int
    digest: int = 0

    def encode(self) -> torch.Tensor:
        """[HEADER_LEN] int64 on the CPU."""
        name = self.spec.dtype.encode("ascii")
        if len(name) > _DTYPE_BYTES:
            raise ValueError(f"dtype name too long for the header: {self.spec.dtype}")
        spec = self.spec
        fields = [_MAGIC, spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim,
                  self.num_blocks, self.tag, self.digest]
        name_words = torch.frombuffer(bytearray(name.ljust(_DTYPE_BYTES, b"\0")), dtype=torch.int64)
        return torch.cat([torch.tensor(fields, dtype=torch.int64), name_words])

    @classmethod
    def decode(cls, words: torch.Tensor) -> TransferHeader:
        """Inverse of encode (`words` may be longer). ValueError if it is not a header of
        this version (or names an unknown dtype)."""
        words = words[:HEADER_LEN].cpu()
        fields = words[:_NUM_FIELDS].tolist()
        magic, num_layers, block_size, num_kv_heads, head_dim, num_blocks, tag, digest = fields
        if magic != _MAGIC:
            raise ValueError(f"not a KV transfer header of this version (magic {magic:#x})")
        dtype = words[_NUM_FIELDS:].numpy().tobytes().rstrip(b"\0").decode("ascii", "replace")
        return cls(KvLayoutSpec(num_layers, block_size, num_kv_heads, head_dim, dtype), num_blocks, tag, digest)


# On the CPU index_copy_ moves one element at a time: viewing rows as the widest
# element that divides them (16-byte complex128 where possible) makes the scatter
# about 2x faster than float32 elements. Bits are only copied, never interpreted.
_WIDE_DTYPES = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16))


def wide_rows(rows: torch.Tensor) -> torch.Tensor:
    """The same bytes as [n, row] of the widest dtype dividing a row."""
    row_bytes = rows.shape[-1] * rows.element_size()
    for size, dtype in _WIDE_DTYPES:
        if row_bytes % size == 0 and (rows.device.type == "cpu" or not dtype.is_complex):
            return rows.view(dtype)
    return rows.view(torch.uint8)


def transfer_scope(stream, device: torch.device) -> contextlib.AbstractContextManager:
    """The calling thread's device and a transfer's side `stream` (CUDA; None: no scope).
    The blocks to send were written on the default stream: the side stream waits for it."""
    if stream is None:
        return contextlib.nullcontext()
    scope = contextlib.ExitStack()
    scope.enter_context(torch.cuda.device(device))
    try:
        stream.wait_stream(torch.cuda.default_stream(device))
    except BaseException:
        scope.close()
        raise
    scope.enter_context(torch.cuda.stream(stream))
    return scope

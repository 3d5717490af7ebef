"""Content hashes of full KV blocks, chained from the first block (prefix caching).

A block's KV depends on its own tokens and on every token before it, so a block
is named by a hash of its parent block's hash and its own token ids: two
requests whose first k blocks hash alike share those blocks' KV exactly. The
chain starts from a root that names what else changes the KV (`extra`: a cache
salt, so that tenants who must not share a cache do not).

The hash is BLAKE2b over the token ids as little-endian 64-bit integers, 128
bits wide: a collision, which would hand a request another prompt's KV, is out
of reach by chance or by design. The gateway computes the same hashes to route
a prompt where its prefix is cached: this module imports nothing heavy.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

BlockHash = bytes

_DIGEST_SIZE = 16
ROOT_HASH: BlockHash = hashlib.blake2b(b"baton-prefix-v1", digest_size=_DIGEST_SIZE).digest()


def root_hash(extra: bytes = b"") -> BlockHash:
    """The parent of a chain's first block: ROOT_HASH, or one named by `extra` too."""
    if not extra:
        return ROOT_HASH
    return hashlib.blake2b(ROOT_HASH + extra, digest_size=_DIGEST_SIZE).digest()


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    packed = array("q", token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """The hash of a full block of `token_ids` that follows the block hashed `parent`."""
    digest = hashlib.blake2b(parent, digest_size=_DIGEST_SIZE)
    digest.update(_token_bytes(token_ids))
    return digest.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, num_blocks: int, root: BlockHash = ROOT_HASH
) -> list[BlockHash]:
    """Extend `hashes` (the chain of `token_ids`' first len(hashes) blocks) to `num_blocks`
    full blocks, in place; returns it. The caller makes sure those tokens exist."""
    parent = hashes[-1] if hashes else root
    for index in range(len(hashes), num_blocks):
        parent = hash_block(parent, token_ids[index * block_size : (index + 1) * block_size])
        hashes.append(parent)
    return hashes


def block_hashes(token_ids: Sequence[int], block_size: int, root: BlockHash = ROOT_HASH) -> list[BlockHash]:
    """The chain of hashes of every full block of `token_ids`."""
    return extend_block_hashes([], token_ids, block_size, len(token_ids) // block_size, root)

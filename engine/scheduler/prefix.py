"""PrefixMatcher: a request's blocks against the prefix cache (engine/kv/prefix_hash.py).

At admission a request starts its table with the cached blocks of the longest
prefix of its own blocks' hash chain, and counts their tokens as computed. A
request that prefills matches at most its tokens but the last, so that its last
token is computed and sampled from; a kv_remote request matches whole prompt
blocks, and its receive skips them. Full blocks are offered to the cache as
their KV is computed (at launch: a later step runs after it) or received. A
request's chain is hashed once, as far as it is needed, and kept on it.
"""

from __future__ import annotations

from engine.kv.manager import NO_PREFIX, KVCacheManager, PrefixHit
from engine.kv.prefix_hash import extend_block_hashes
from engine.request import PENDING_TOKEN, Request

class PrefixMatcher:
    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.block_size = kv.block_size

    def hit(self, request: Request) -> PrefixHit:
        """The cached blocks a request admitted now would start with: of its whole prompt
        if its KV arrives from elsewhere, else of its tokens but the last. A query: it
        changes nothing but the request's memo of its own hash chain (extended as needed)."""
        if not self.kv.enable_prefix_caching or request.prompt_logprobs is not None:
            return NO_PREFIX  # a prompt's logprobs come from computing every position
        if request.kv_remote:
            num_blocks = request.num_prompt_tokens // self.block_size
        else:
            num_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._hashes(request, num_blocks)
        return self.kv.match_prefix(hashes[:num_blocks] if len(hashes) > num_blocks else hashes)

    def cache_computed(self, request: Request) -> None:
        """Offer the request's full blocks whose KV is computed to the prefix cache. With
        overlapped scheduling the last token may be one a step in flight sampled and has
        not reported (PENDING_TOKEN): its block waits for a later step, when the token is
        known (the hash chain must name real tokens)."""
        if not self.kv.enable_prefix_caching:
            return
        token_ids = request.all_token_ids
        num_known = len(token_ids) - (token_ids[-1] == PENDING_TOKEN)
        num_blocks = min(request.num_computed_tokens, num_known) // self.block_size
        if num_blocks > self.kv.num_registered(request.request_id):
            self.kv.cache_blocks(request.request_id, self._hashes(request, num_blocks), num_blocks)

    def _hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The request's chain, hashed as far as its first `num_blocks` blocks at least."""
        hashes = request.block_hashes
        if len(hashes) < num_blocks:
            extend_block_hashes(hashes, request.all_token_ids, self.block_size, num_blocks)
        return hashes

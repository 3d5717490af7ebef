"""Proposals by a draft model: a small model with the target's vocabulary drafts a row's
next k tokens greedily, on the target's device, from a paged KV cache of its own.

Each row that speculates has a shadow request here: the row's tokens, and how many of them
the draft's cache holds. Before a step the shadows catch up with their rows in one batched
forward pass of the draft (a new row's whole prompt and output, else the tokens accepted
since; the positions after a rejected proposal are recomputed, their KV being the
proposal's), which also drafts each row's first token; k - 1 more passes of one token a
row draft the rest. Drafting is greedy: the engine keeps a proposal only where the
target's own sample agrees with it (engine/spec_decode/speculator.py), which is exact for
any proposal, so the draft only decides how many are accepted. A row whose shadow cannot
have the blocks it needs does not speculate this step; a shadow whose row left the batch
(finished, preempted) is dropped and its blocks freed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kv.cache import KVCache, KVLayout
from engine.kv.manager import KVCacheManager, cdiv
from engine.model.loader import LoadedModel, load_model
from engine.request import Request
from engine.runner.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler.output import SchedulerOutput

_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


class DraftProposer:
    """A draft model, its KV cache and the rows' shadows (see the module's docstring)."""

    def __init__(self, model: str, dtype: torch.dtype, max_model_len: int, vocab_size: int, device: torch.device,
                 block_size: int, num_blocks: int, attention_backend: str = "auto", seed: int = 0,
                 loaded: LoadedModel | None = None) -> None:
        if loaded is None:
            loaded = load_model(model, dtype, max_model_len, attention_backend, device, seed)
        arch = loaded.arch
        if arch.vocab_size != vocab_size:
            raise ValueError(f"the draft model {model!r} has a vocabulary of {arch.vocab_size} tokens; the target's "
                             f"has {vocab_size}: a draft must share the target's tokenizer")
        self.max_model_len = min(max_model_len, loaded.max_model_len)
        self.kv = KVCacheManager(num_blocks, 0, block_size, max_blocks_per_seq=cdiv(self.max_model_len, block_size),
                                 enable_prefix_caching=False)
        layout = KVLayout(arch.num_layers, block_size, arch.num_kv_heads, arch.head_dim, dtype)
        self.runner = ModelRunner(loaded.model, KVCache(layout, num_blocks, 0, device), self.kv,
                                  num_heads=arch.num_heads, seed=seed)
        self.shadows: dict[str, Request] = {}

    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> None:
        """Set each request's `spec_token_ids` to the draft's next `num_tokens[i]` tokens
        (fewer, or none, where its cache runs out); drop the shadows of other rows."""
        keep = {request.request_id for request in requests}
        for request_id in [rid for rid in self.shadows if rid not in keep]:
            self.release(request_id)
        drafting = []
        for request, k in zip(requests, num_tokens):
            request.spec_token_ids = []
            k = min(k, self.max_model_len - len(request.all_token_ids))
            if k > 0 and self._sync(request):
                drafting.append((request, k))
        for step in range(max((k for _, k in drafting), default=0)):
            rows = [(request, self.shadows[request.request_id]) for request, k in drafting
                    if k > step and len(request.spec_token_ids) == step]
            out = SchedulerOutput()
            for request, shadow in rows:
                num_new = len(shadow.all_token_ids) - shadow.num_computed_tokens
                if not self.kv.allocate_slots(shadow.request_id, shadow.num_computed_tokens + num_new):
                    continue  # (its proposals so far stand)
                out.requests.append(shadow)
                out.num_scheduled_tokens.append(num_new)
            if not out.requests:
                break
            out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens)
            drafted = self.runner.launch(out).result()
            by_id = {request.request_id: request for request, _ in rows}
            for shadow, token_id in zip(drafted.requests, drafted.token_ids):
                shadow.num_computed_tokens = len(shadow.all_token_ids)
                shadow.all_token_ids.append(token_id)
                by_id[shadow.request_id].spec_token_ids.append(token_id)

    def release(self, request_id: str) -> None:
        """Drop a row's shadow and free its blocks (none: nothing to do)."""
        if self.shadows.pop(request_id, None) is not None:
            self.kv.free(request_id)

    def _sync(self, request: Request) -> bool:
        """Make the request's shadow hold its tokens, its cache what still matches them; False
        when the shadow could not have a block table (the draft's cache is full)."""
        tokens = request.all_token_ids
        shadow = self.shadows.get(request.request_id)
        if shadow is None:
            if not self.kv.allocate_slots(request.request_id, 0):
                return False
            shadow = self.shadows[request.request_id] = Request(request.request_id, list(tokens), _GREEDY)
            return True
        held = shadow.all_token_ids
        common = next((i for i, (a, b) in enumerate(zip(held, tokens)) if a != b), min(len(held), len(tokens)))
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, common, len(tokens) - 1)
        shadow.all_token_ids = list(tokens)
        return True

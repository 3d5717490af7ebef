"""Batched sampler: logits [S, V] -> one token per row, vectorized over rows.

Order of operations (as in vLLM / Hugging Face):

    repetition penalty -> banned ids -> greedy rows: argmax
                                     -> other rows: temperature -> top-k -> top-p -> min-p -> race

Every sampled row first takes its top-C candidates (topk; temperature keeps
the order). Truncation is one logit threshold per row (keep x >= threshold),
so top-k, top-p and min-p compose by `max`; top-p sorts the full vocab only
for rows whose nucleus is wider than the candidates.

The draw is the exponential race: argmax_i w_i / q_i with q_i ~ Exp(1) picks
i with probability w_i / sum(w), so the weights w = exp(x - max) need no
normalizing. Rows are drawn three ways:

    unseeded, support inside the candidates   race over the C candidates
    unseeded, wider support                   pick "candidate or not" with its
                                              mass, then race there (exact)
    seeded                                    race over all V tokens

A seeded row draws exactly one noise vector [V] from its own generator per
sampled token, and everything else it depends on is computed row-locally, so
its tokens do not depend on batch size or row position. Unseeded rows share
the engine generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
from torch import Tensor

from engine import kernels
from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams

# Candidates per sampled row. Large enough to hold a typical nucleus and most
# of an LLM's probability mass; rows needing more fall back to full-vocab work.
NUM_CANDIDATES = 256


def make_generator(seed: int) -> torch.Generator:
    """The per-request generator of a seeded request (CPU; noise is drawn on CPU)."""
    return torch.Generator().manual_seed(seed)


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]  # [S]
    # None when no row asked for logprobs; else per row, None for rows that did not.
    logprobs: list[TokenLogprobs | None] | None


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    """Sampling inputs for the S rows that sample this step, in row order.

    Built by the runner each step with `build`. `generators[i]` is row i's own
    generator when its request is seeded, else None (engine generator).
    `token_history[i]` (prompt + output ids) is kept only for rows with a
    repetition penalty and only when `any_penalty`. `banned_token_ids[i]` lists
    ids masked to -inf for row i (EOS / stop ids before min_tokens is reached).
    """

    temperature: Tensor  # [S] float32, 1.0 on greedy rows
    top_k: Tensor  # [S] int64, 0 = off
    top_p: Tensor  # [S] float32, 1.0 = off
    min_p: Tensor  # [S] float32, 0.0 = off
    repetition_penalty: Tensor  # [S] float32, 1.0 = off
    greedy_rows: Tensor | None  # [G] int64 row indices; None when no row is greedy
    random_rows: Tensor | None  # [R] int64 row indices; None when no row samples
    all_greedy: bool
    any_penalty: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    generators: tuple[torch.Generator | None, ...]
    token_history: list[Sequence[int]] | None
    banned_token_ids: list[Sequence[int]] | None
    num_logprobs: tuple[int | None, ...]  # per row, from SamplingParams.logprobs
    max_num_logprobs: int | None  # None when no row asked for logprobs

    @property
    def num_rows(self) -> int:
        return len(self.generators)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None] | None = None,
        token_histories: Sequence[Sequence[int]] | None = None,
        banned_token_ids: Sequence[Sequence[int]] | None = None,
    ) -> SamplingBatch:
        num_rows = len(params)
        if generators is None:
            generators = (None,) * num_rows
        assert len(generators) == num_rows
        is_greedy = [p.is_greedy for p in params]
        all_greedy = all(is_greedy)
        any_penalty = any(p.repetition_penalty != 1.0 for p in params)
        history = None
        if any_penalty:
            if token_histories is None:
                raise ValueError("token_histories are required when a row has a repetition penalty")
            history = [  # not copied: the batch lives for one step
                h if p.repetition_penalty != 1.0 else ()
                for p, h in zip(params, token_histories, strict=True)
            ]
        banned = None
        if banned_token_ids is not None and any(banned_token_ids):
            banned = list(banned_token_ids)
            assert len(banned) == num_rows
        random = [not g for g in is_greedy]
        num_logprobs = tuple(p.logprobs for p in params)
        requested = [n for n in num_logprobs if n is not None]
        # Greedy rows get neutral values, so vectorized code can ignore them.
        pairs = list(zip(params, is_greedy))
        f32, i64 = torch.float32, torch.int64
        return cls(
            temperature=torch.tensor([1.0 if g else p.temperature for p, g in pairs], dtype=f32),
            top_k=torch.tensor([0 if g else p.top_k for p, g in pairs], dtype=i64),
            top_p=torch.tensor([1.0 if g else p.top_p for p, g in pairs], dtype=f32),
            min_p=torch.tensor([0.0 if g else p.min_p for p, g in pairs], dtype=f32),
            repetition_penalty=torch.tensor([p.repetition_penalty for p in params], dtype=f32),
            greedy_rows=_rows_where(is_greedy),
            random_rows=_rows_where(random),
            all_greedy=all_greedy,
            any_penalty=any_penalty,
            any_top_k=any(r and p.top_k > 0 for p, r in zip(params, random)),
            any_top_p=any(r and p.top_p < 1.0 for p, r in zip(params, random)),
            any_min_p=any(r and p.min_p > 0.0 for p, r in zip(params, random)),
            generators=tuple(generators),
            token_history=history,
            banned_token_ids=banned,
            num_logprobs=num_logprobs,
            max_num_logprobs=max(requested) if requested else None,
        )


def _rows_where(flags: list[bool]) -> Tensor | None:
    rows = [i for i, f in enumerate(flags) if f]
    return torch.tensor(rows, dtype=torch.int64) if rows else None


class Sampler:
    """Turns logits [S, V] into one token per row; see the module docstring."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator  # engine-wide, for unseeded rows

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        num_rows, vocab_size = logits.shape  # [S, V]
        assert num_rows == batch.num_rows, (num_rows, batch.num_rows)
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        needs_edit = batch.any_penalty or batch.banned_token_ids is not None
        if batch.all_greedy and not needs_edit:
            token_ids = _argmax_rows(logits)  # [S]
        else:
            # NOTE: without edits x may alias the caller's logits; _sample never writes to it.
            x = logits.to(dtype, copy=needs_edit)  # [S, V]
            if batch.any_penalty:
                apply_repetition_penalty(x, batch.token_history, batch.repetition_penalty)
            if batch.banned_token_ids is not None:
                _mask_ids(x, batch.banned_token_ids, float("-inf"))
            if batch.all_greedy:
                token_ids = _argmax_rows(x)
            elif batch.greedy_rows is None:
                token_ids = self._sample(x, batch, batch.random_rows)
            else:
                token_ids = torch.empty(num_rows, dtype=torch.int64, device=x.device)
                token_ids[batch.greedy_rows] = _argmax_rows(x[batch.greedy_rows])
                rows = batch.random_rows
                token_ids[rows] = self._sample(x[rows], batch, rows)
        logprobs = None
        if batch.max_num_logprobs is not None:
            logprobs = _gather_logprobs(logits.to(dtype), token_ids, batch)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)

    def _sample(self, logits: Tensor, batch: SamplingBatch, rows: Tensor) -> Tensor:
        """Sample the random rows `rows` ([R] batch indices) from their
        (penalized) logits [R, V]; `logits` is read, never written."""
        num_rows, vocab_size = logits.shape
        sub = None if num_rows == batch.num_rows else rows  # None: every batch row is here
        temperature = _take(batch.temperature, sub, logits)[:, None]  # [R, 1]
        generators = [batch.generators[r] for r in rows.tolist()]
        top_k = _take(batch.top_k, sub, logits)
        num_candidates = min(vocab_size, max(NUM_CANDIDATES, int(top_k.max())))
        # Temperature keeps the order, so take candidates from the raw logits.
        cand_raw, cand_ids = logits.topk(num_candidates, dim=-1)  # [R, C], descending
        cand_vals = cand_raw / temperature  # [R, C], bitwise equal to tempered[cand_ids]
        tempered = logits / temperature if batch.any_top_p else None  # [R, V]
        is_seeded = torch.tensor([g is not None for g in generators], device=logits.device)

        threshold = torch.full_like(cand_vals[:, :1], float("-inf"))  # [R, 1]: keep x >= threshold
        if batch.any_top_k:
            kth = cand_vals.gather(1, (top_k.clamp(1, num_candidates) - 1)[:, None])  # [R, 1]
            threshold = torch.where(top_k[:, None] > 0, kth, threshold)
        if batch.any_top_p:
            top_p = _take(batch.top_p, sub, logits)
            nucleus = _top_p_threshold(tempered, cand_vals, threshold, top_p, is_seeded)
            threshold = torch.maximum(threshold, nucleus)
        if batch.any_min_p:
            min_p = _take(batch.min_p, sub, logits)
            # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p); log(0) = -inf keeps all.
            threshold = torch.maximum(threshold, cand_vals[:, :1] + min_p.log()[:, None])

        # Three kinds of rows: unseeded rows whose whole support lies in the
        # candidates; other unseeded rows; seeded rows (full [V] noise).
        in_candidates = ~is_seeded
        if num_candidates < vocab_size:
            in_candidates &= threshold[:, 0] > cand_vals[:, -1]
        wide = ~(in_candidates | is_seeded)

        def tempered_rows(mask: Tensor) -> tuple[Tensor, Tensor]:
            """(row indices [N], a private copy of their tempered logits [N, V])."""
            idx = mask.nonzero()[:, 0]
            if len(idx) == num_rows:
                return idx, tempered if tempered is not None else logits / temperature
            if tempered is not None:
                return idx, tempered[idx]
            return idx, logits[idx] / temperature[idx]

        token_ids = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
        if bool(in_candidates.any()):
            idx = in_candidates.nonzero()[:, 0]
            weights = _weights(cand_vals[idx], cand_vals[idx, :1], threshold[idx])  # [Nc, C]
            token_ids[idx] = _race_candidates(weights, cand_ids[idx], self.generator)
        if bool(wide.any()):
            idx, x = tempered_rows(wide)
            token_ids[idx] = _race_two_stage(
                x, cand_vals[idx], cand_ids[idx], threshold[idx], self.generator
            )
        if bool(is_seeded.any()):
            idx, x = tempered_rows(is_seeded)
            seeded_generators = [generators[i] for i in idx.tolist()]
            token_ids[idx] = _race_full(x, threshold[idx], seeded_generators)
        return token_ids


def _weights(x: Tensor, row_max: Tensor, threshold: Tensor) -> Tensor:
    """Unnormalized probabilities exp(x - row_max) [N, K], 0 below threshold [N, 1]."""
    weights = (x - row_max).exp_()
    if bool((threshold > float("-inf")).any()):
        weights.masked_fill_(x < threshold, 0.0)
    return weights


def _argmax_rows(x: Tensor) -> Tensor:
    """Greedy picks: the native CPU kernel when this process has loaded it, else torch."""
    if (x.device.type == "cpu" and x.stride(-1) == 1 and x.dtype in kernels.CPU_KERNEL_DTYPES
            and kernels.cpu_kernels_loaded()):
        return kernels.argmax_rows(x)
    return x.argmax(dim=-1)


def _race_candidates(weights: Tensor, cand_ids: Tensor, generator: torch.Generator) -> Tensor:
    """Exponential race among candidates: weights [N, C] -> token ids [N]."""
    scores = weights / _exp_noise(weights.shape, weights.dtype, generator, weights.device)
    return cand_ids.gather(1, scores.argmax(dim=-1, keepdim=True))[:, 0]


def _race_two_stage(
    x: Tensor, cand_vals: Tensor, cand_ids: Tensor, threshold: Tensor, generator: torch.Generator
) -> Tensor:
    """Exact sampling for unseeded rows whose support is wider than the
    candidates, with full-vocab noise only for the rows that need it: first
    pick "a candidate" with the candidates' share of the mass (one uniform per
    row), then race among the candidates or among the other tokens.
    x [N, V] (tempered, edited in place), cand_vals / cand_ids [N, C]."""
    row_max = cand_vals[:, :1]
    if bool((threshold > float("-inf")).any()):
        x.masked_fill_(x < threshold, float("-inf"))
    weights = x.sub_(row_max).exp_()  # [N, V]
    cand_weights = _weights(cand_vals, row_max, threshold)  # [N, C]
    uniform = _fill_uniform(torch.empty(len(x), dtype=x.dtype, device=x.device), generator)
    pick_candidate = uniform * weights.sum(dim=-1) < cand_weights.sum(dim=-1)  # [N]
    token_ids = torch.empty(len(x), dtype=torch.int64, device=x.device)
    idx = pick_candidate.nonzero()[:, 0]
    if len(idx):
        token_ids[idx] = _race_candidates(cand_weights[idx], cand_ids[idx], generator)
    idx = (~pick_candidate).nonzero()[:, 0]
    if len(idx):
        rest = weights[idx].scatter_(1, cand_ids[idx], 0.0)  # [Nt, V], candidates excluded
        noise = _exp_noise(rest.shape, rest.dtype, generator, rest.device)
        token_ids[idx] = rest.div_(noise).argmax(dim=-1)
    return token_ids


def _race_full(x: Tensor, threshold: Tensor, generators: list[torch.Generator]) -> Tensor:
    """Exponential race over the whole vocab for seeded rows: x [N, V]
    (tempered, edited in place); row j draws exactly one noise vector [V]
    from generators[j], so its token depends on nothing else in the batch."""
    x.masked_fill_(x < threshold, float("-inf"))
    weights = x.sub_(x.max(dim=-1, keepdim=True).values).exp_()  # [N, V]
    uniform = torch.empty_like(weights)
    for j, generator in enumerate(generators):
        _fill_uniform(uniform[j], generator)
    return weights.div_(uniform.log_().neg_()).argmax(dim=-1)


def apply_repetition_penalty(
    x: Tensor, token_history: Sequence[Sequence[int]], penalty: Tensor
) -> None:
    """Hugging Face RepetitionPenaltyLogitsProcessor, in place on x [S, V]:
    each seen token's logit is divided by the penalty if positive, else multiplied."""
    row_idx, col_idx = _flat_index(token_history, x.device)
    if len(col_idx) == 0:
        return
    seen = x[row_idx, col_idx]  # [N]; duplicates read and write the same value
    p = penalty.to(x.device, x.dtype)[row_idx]
    x[row_idx, col_idx] = torch.where(seen < 0, seen * p, seen / p)


def _top_p_threshold(
    x: Tensor, cand_vals: Tensor, threshold: Tensor, top_p: Tensor, is_seeded: Tensor
) -> Tensor:
    """Per-row logit threshold [R, 1] of the nucleus: the smallest set of most
    likely tokens (among those >= `threshold`, i.e. after top-k) whose mass
    >= top_p. Rows with top_p == 1 get -inf (off). x [R, V] are the tempered
    logits, cand_vals [R, C] their top-C values, descending.

    Masses are exp(x - row max), unnormalized. On seeded rows every sum is a
    cumsum, a sequential per-row scan, so the result does not depend on the
    batch (ATen splits a lone row's sum across threads, changing its rounding)."""
    vocab_size = x.shape[1]
    num_candidates = cand_vals.shape[1]
    row_max = cand_vals[:, :1]  # [R, 1]
    has_top_k = threshold[:, 0] > float("-inf")
    cum = _cumulative_mass(cand_vals, row_max, threshold)  # [R, C]
    total = cum[:, -1]  # [R]: all the mass on top-k rows (every survivor is a candidate)
    if not bool(has_top_k.all()):
        weights = (x - row_max).exp_()  # [R, V]
        full = weights.sum(dim=-1)
        if bool(is_seeded.any()):
            full[is_seeded] = weights[is_seeded].cumsum_(dim=-1)[:, -1]
        total = torch.where(has_top_k, total, full)
    target = (top_p * total)[:, None]  # [R, 1]
    rank = torch.searchsorted(cum, target)[:, 0]  # first rank whose mass reaches top_p
    cutoff = cand_vals.gather(1, rank.clamp(max=num_candidates - 1)[:, None])
    wider = (rank >= num_candidates) & (top_p < 1)  # nucleus not inside the candidates
    if num_candidates < vocab_size and bool(wider.any()):
        rows = wider.nonzero()[:, 0]
        sorted_vals = _sort_descending(x[rows])  # [W, V]
        cum = _cumulative_mass(sorted_vals, row_max[rows], threshold[rows])
        rank = torch.searchsorted(cum, target[rows])[:, 0].clamp(max=vocab_size - 1)
        cutoff[rows] = sorted_vals.gather(1, rank[:, None])
    return torch.where(top_p[:, None] < 1, cutoff, float("-inf"))


def _cumulative_mass(sorted_vals: Tensor, row_max: Tensor, threshold: Tensor) -> Tensor:
    """Inclusive cumulative exp(x - row_max) [R, C] over values sorted
    descending, counting only values >= threshold; non-decreasing."""
    mass = (sorted_vals - row_max).exp_()
    if bool((threshold > float("-inf")).any()):
        mass.masked_fill_(sorted_vals < threshold, 0.0)
    return mass.cumsum_(dim=-1)


def _sort_descending(x: Tensor) -> Tensor:
    if x.device.type == "cpu":  # numpy's SIMD sort of values is >10x faster than torch.sort here
        return torch.from_numpy(np.sort(x.numpy(), axis=-1)).flip(-1)
    return x.sort(dim=-1, descending=True).values


def _exp_noise(
    shape: Sequence[int], dtype: torch.dtype, generator: torch.Generator, device: torch.device
) -> Tensor:
    """Exp(1) noise as -log(U), U ~ U[0, 1): strictly positive (U < 1), and
    ~3x faster on CPU than Tensor.exponential_."""
    uniform = _fill_uniform(torch.empty(tuple(shape), dtype=dtype, device=device), generator)
    return uniform.log_().neg_()


def skip_sample_draw(generator: torch.Generator, vocab_size: int, logits_dtype: torch.dtype,
                     num_draws: int = 1) -> None:
    """Advance a seeded request's generator past the draws sampling `num_draws` tokens
    makes, as if this sampler had sampled them (another engine sampled them: the first
    token, or what an earlier attempt streamed). One draw at a time, as sampling makes
    them, so the generator ends in the same state."""
    dtype = torch.float64 if logits_dtype == torch.float64 else torch.float32
    noise = torch.empty(vocab_size, dtype=dtype)
    for _ in range(num_draws):
        _fill_uniform(noise, generator)


def _fill_uniform(out: Tensor, generator: torch.Generator) -> Tensor:
    """U[0, 1) into `out` from `generator`; the values depend only on the
    generator's state and out's shape, not on where `out` lives in memory."""
    if generator.device == out.device:
        return out.uniform_(generator=generator)
    draw = torch.rand(out.shape, generator=generator, dtype=out.dtype, device=generator.device)
    return out.copy_(draw)


def _mask_ids(x: Tensor, ids_per_row: Sequence[Sequence[int]], value: float) -> None:
    row_idx, col_idx = _flat_index(ids_per_row, x.device)
    if len(col_idx):
        x[row_idx, col_idx] = value


def _flat_index(
    ids_per_row: Sequence[Sequence[int]], device: torch.device
) -> tuple[Tensor, Tensor]:
    """(row, column) index pairs [N] for ragged per-row id lists."""
    lengths = torch.tensor([len(ids) for ids in ids_per_row], dtype=torch.int64)
    row_idx = torch.repeat_interleave(torch.arange(len(ids_per_row)), lengths)
    col_idx = torch.tensor(list(chain.from_iterable(ids_per_row)), dtype=torch.int64)
    return row_idx.to(device), col_idx.to(device)


def _take(values: Tensor, rows: Tensor | None, like: Tensor) -> Tensor:
    """values [S] restricted to `rows` (all when None), on like's device; floats in like's dtype."""
    if rows is not None:
        values = values[rows]
    dtype = like.dtype if values.is_floating_point() else values.dtype
    return values.to(like.device, dtype)


def _gather_logprobs(
    logits: Tensor, token_ids: Tensor, batch: SamplingBatch
) -> list[TokenLogprobs | None]:
    """Per row that asked: the sampled token's logprob and the top-n, from the raw logits [S, V]."""
    rows = [i for i, n in enumerate(batch.num_logprobs) if n is not None]
    logprobs = logits[rows].log_softmax(dim=-1)  # [L, V], raw logits
    sampled = logprobs.gather(1, token_ids[rows][:, None])[:, 0].tolist()
    top_vals, top_ids = logprobs.topk(batch.max_num_logprobs, dim=-1)  # [L, N], descending
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    out: list[TokenLogprobs | None] = [None] * batch.num_rows
    ids = token_ids.tolist()
    for j, i in enumerate(rows):
        n = batch.num_logprobs[i]
        out[i] = TokenLogprobs(
            token_id=ids[i],
            logprob=sampled[j],
            top_logprobs=tuple(zip(top_ids[j][:n], top_vals[j][:n])),
        )
    return out

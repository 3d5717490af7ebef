"""Batched sampler: logits [S, V] -> one token per row, vectorized over rows,
launched without waiting on the device.

Order of operations (as in vLLM / Hugging Face):

    repetition penalty -> presence / frequency penalties -> logit bias -> allowed ids -> banned ids
        -> a structured output's token bitmask
        -> greedy rows: argmax
        -> other rows: temperature -> top-k -> top-p -> min-p -> race

Every sampled row first takes its top-C candidates (topk; temperature keeps
the order; C >= every row's top-k). Truncation is one logit threshold per row
(keep x >= threshold), so top-k, top-p and min-p compose by `max`. A row with
top-k keeps only candidates (ties with its k-th value past the C-th candidate
are dropped: Hugging Face keeps them), so its nucleus lies in them too; top-p
sorts the full vocab only for rows without top-k whose nucleus is wider than
the candidates.

The draw is the exponential race: argmax_i w_i / q_i with q_i ~ Exp(1) picks
i with probability w_i / sum(w), so the weights w = exp(x - max) need no
normalizing. Rows are drawn three ways:

    unseeded, support inside the candidates   race over the C candidates
    unseeded, wider support                   pick "candidate or not" with its
                                              mass, then race there (exact)
    seeded                                    race over all V tokens

No host syncs: every branch on the host depends only on the rows'
SamplingParams (SamplingBatch), never on device values. `sample` launches the
step's work and starts copying the tokens to the host; `SampledTokens.result()`
waits for that copy, the step's one sync. Where the data could spare work (a
support or a nucleus that fits the candidates after all), the sampler asks
`_host_can_read`: on CPU a read is free, so it looks and skips what no row
needs; on any other device it takes the general path, exact for every row (the
two-stage race for every unseeded row without top-k, the full sort for every
nucleus without top-k).

A seeded row draws exactly one noise vector [V] from its own generator per
sampled token, and everything else it depends on is computed row-locally, so
its tokens do not depend on batch size or row position. Its generator lives on
the engine's device: its draws are reproducible on one device type, but CPU and
GPU generators make different noise, so the same seed may give other tokens on
a GPU than on a CPU. Unseeded rows share the engine generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from engine import kernels
from engine.outputs import TokenLogprobs
from engine.sampling.batch import PENDING_OUTPUT, SamplingBatch, SamplingRows
from engine.sampling.grammar import apply_bitmask

# Candidates per sampled row. Large enough to hold a typical nucleus and most
# of an LLM's probability mass; rows needing more fall back to full-vocab work.
NUM_CANDIDATES = 256


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-request generator of a seeded request, on the engine's device."""
    return torch.Generator(device=device).manual_seed(seed)


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]  # [S]
    # None when no row asked for logprobs; else per row, None for rows that did not.
    logprobs: list[TokenLogprobs | None] | None


@dataclass(frozen=True, slots=True)
class SampledTokens:
    """One step's sampled tokens on the logits' device, their copy to the host
    under way. `result()` waits for that copy (the step's one sync) and makes the
    host record."""

    token_ids: Tensor  # [S] int64
    logprobs: Tensor | None  # [L] the sampled tokens' logprobs, rows that asked (batch.logprob_rows)
    top_logprobs: Tensor | None  # [L, N] descending, N = batch.max_num_logprobs
    top_token_ids: Tensor | None  # [L, N] int64
    num_logprobs: tuple[int | None, ...]  # per row, from SamplingParams.logprobs
    host: tuple[Tensor, ...]  # the tensors above on the host: pinned copies on CUDA
    copied: torch.cuda.Event | None  # recorded after the copies (CUDA)

    def result(self) -> SamplerOutput:
        if self.copied is not None:
            self.copied.synchronize()
        token_ids = self.host[0].tolist()
        if self.logprobs is None:
            return SamplerOutput(token_ids=token_ids, logprobs=None)
        sampled, top_vals, top_ids = (tensor.tolist() for tensor in self.host[1:])
        rows = [i for i, n in enumerate(self.num_logprobs) if n is not None]
        logprobs: list[TokenLogprobs | None] = [None] * len(token_ids)
        for j, i in enumerate(rows):
            n = self.num_logprobs[i]
            logprobs[i] = TokenLogprobs(
                token_id=token_ids[i],
                logprob=sampled[j],
                top_logprobs=tuple(zip(top_ids[j][:n], top_vals[j][:n])),
            )
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)


class Sampler:
    """Turns logits [S, V] into one token per row; see the module docstring."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator  # engine-wide, for unseeded rows, on the logits' device

    def __call__(self, logits: Tensor, batch: SamplingBatch) -> SamplerOutput:
        return self.sample(logits, batch).result()

    def sample(self, logits: Tensor, batch: SamplingBatch, last_token_ids: Tensor | None = None,
               grammar: tuple[Tensor, Tensor] | None = None) -> SampledTokens:
        """Launch the step's sampling and start copying its tokens to the host.
        `last_token_ids` [S] int64 (on the device): the token each row was fed this
        step, counted as seen by the penalties (the host history may not hold it yet).
        `grammar`: the rows [G] with a structured output and their next-token bitmask
        [G, W] int32 (engine.sampling.grammar), on the device."""
        num_rows, vocab_size = logits.shape  # [S, V]
        assert num_rows == batch.num_rows, (num_rows, batch.num_rows)
        dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        needs_edit = batch.edits_logits or grammar is not None
        if batch.all_greedy and not needs_edit:
            token_ids = _argmax_rows(logits)  # [S]
        else:
            # NOTE: without edits x may alias the caller's logits; nothing below writes to it.
            x = logits.to(dtype, copy=needs_edit)  # [S, V]
            if batch.edits_logits:
                apply_logit_edits(x, batch, last_token_ids)
            if grammar is not None:
                apply_bitmask(x, *grammar)
            token_ids = self._draw(x, batch)
        logprobs = _logprobs(logits, dtype, token_ids, batch) if batch.max_num_logprobs is not None else ()
        return _start_copy(token_ids, logprobs, batch.num_logprobs)

    def _draw(self, x: Tensor, batch: SamplingBatch) -> Tensor:
        """Token ids [S] from the (penalized) logits x [S, V], read, never written."""
        if batch.all_greedy:
            return _argmax_rows(x)
        classes = [(rows, draw) for rows, draw in ((batch.unseeded, self._sample_unseeded),
                                                   (batch.seeded, _sample_seeded)) if rows is not None]
        if classes[0][0].rows is None:  # one class holds every row, in order
            rows, draw = classes[0]
            return draw(x, rows)
        token_ids = torch.empty(batch.num_rows, dtype=torch.int64, device=x.device)
        if batch.greedy_rows is not None:
            token_ids[batch.greedy_rows] = _argmax_rows(x[batch.greedy_rows])
        for rows, draw in classes:
            token_ids[rows.rows] = draw(x[rows.rows], rows)
        return token_ids

    def _sample_unseeded(self, x: Tensor, rows: SamplingRows) -> Tensor:
        """Token ids [N] of unseeded rows from their logits x [N, V] (read, never written)."""
        num_candidates = min(x.shape[1], max(NUM_CANDIDATES, rows.max_top_k))
        temperature = rows.temperature.to(x.dtype)[:, None]  # [N, 1]
        # Temperature keeps the order, so take candidates from the raw logits.
        cand_raw, cand_ids = x.topk(num_candidates, dim=-1)  # [N, C], descending
        cand_vals = cand_raw / temperature  # [N, C], bitwise equal to tempered[cand_ids]
        num_wide = rows.num_wide if num_candidates < x.shape[1] else 0
        # [W, V]: the tempered logits of the rows whose support may pass the candidates,
        # made here when some have a nucleus to find.
        tempered = x[:num_wide] / temperature[:num_wide] if num_wide and rows.num_nucleus else None
        threshold = _threshold(rows, cand_vals, tempered, row_local=False)  # [N, 1]
        weights = _weights(cand_vals, cand_vals[:, :1], threshold)  # [N, C]
        token_ids = _race_candidates(weights, cand_ids, self.generator)
        if num_wide:
            wide = slice(0, num_wide)  # without top-p or min-p, no threshold keeps them in the candidates
            if rows.any_top_p or rows.any_min_p:
                wide = _rows_where(threshold[wide, 0] <= cand_vals[wide, -1])
            if wide is not None:
                wide_x = tempered[wide] if tempered is not None else x[wide] / temperature[wide]
                token_ids[wide] = _race_two_stage(
                    wide_x, cand_vals[wide], cand_ids[wide], threshold[wide], weights[wide], token_ids[wide],
                    self.generator,
                )
        return token_ids


def _sample_seeded(x: Tensor, rows: SamplingRows) -> Tensor:
    """Token ids [N] of seeded rows from their logits x [N, V] (read, never written):
    every row computed on its own and raced over the whole vocab."""
    num_candidates = min(x.shape[1], max(NUM_CANDIDATES, rows.max_top_k))
    temperature = rows.temperature.to(x.dtype)[:, None]  # [N, 1]
    cand_vals = x.topk(num_candidates, dim=-1).values / temperature  # [N, C], descending
    tempered = x / temperature  # [N, V]
    threshold = _threshold(rows, cand_vals, tempered if num_candidates < x.shape[1] else None, row_local=True)
    return _race_full(tempered, threshold, rows.generators)


def _host_can_read(tensor: Tensor) -> bool:
    """Whether reading `tensor` on the host is free (CPU), so the sampler may look at
    the data to skip work no row needs. Elsewhere a read waits for the device: the
    sampler then takes the path that is exact for every row."""
    return tensor.device.type == "cpu"


def _any(mask: Tensor) -> bool:
    """Whether any of `mask` holds; True (assume so) where the host cannot read it."""
    return not _host_can_read(mask) or bool(mask.any())


def _rows_where(mask: Tensor) -> slice | Tensor | None:
    """The rows where `mask` [N] holds, where the host can read it: None when none,
    an index tensor when some. Otherwise (and when all) the slice of all N rows."""
    every = slice(0, len(mask))
    if not _host_can_read(mask):
        return every
    rows = mask.nonzero()[:, 0]
    return None if not len(rows) else every if len(rows) == len(mask) else rows


def _threshold(rows: SamplingRows, cand_vals: Tensor, tempered: Tensor | None, row_local: bool) -> Tensor:
    """Per-row logit threshold [N, 1] of top-k, top-p and min-p (keep x >= threshold).
    cand_vals [N, C] are the tempered candidates, descending; `tempered` [>= T, V]
    the tempered logits of the first rows, at least the T nucleus rows (top-p
    without top-k); None when there are none or every survivor is a candidate (C = V)."""
    num_candidates = cand_vals.shape[1]
    threshold = torch.full_like(cand_vals[:, :1], float("-inf"))  # [N, 1]
    if rows.any_top_k:
        kth = cand_vals.gather(1, (rows.top_k.clamp(1, num_candidates) - 1)[:, None])  # [N, 1]
        threshold = torch.where(rows.top_k[:, None] > 0, kth, threshold)
    if rows.any_top_p:
        nucleus = None if tempered is None else tempered[: rows.num_nucleus]
        top_p = rows.top_p.to(cand_vals.dtype)
        threshold = torch.maximum(threshold, _top_p_threshold(cand_vals, threshold, top_p, nucleus, row_local))
    if rows.any_min_p:
        min_p = rows.min_p.to(cand_vals.dtype)
        # p_i < min_p * p_max  <=>  x_i < x_max + log(min_p); log(0) = -inf keeps all.
        threshold = torch.maximum(threshold, cand_vals[:, :1] + min_p.log()[:, None])
    return threshold


def _weights(x: Tensor, row_max: Tensor, threshold: Tensor) -> Tensor:
    """Unnormalized probabilities exp(x - row_max) [N, K], 0 below threshold [N, 1]."""
    weights = (x - row_max).exp_()
    if _any(threshold > float("-inf")):
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
    x: Tensor, cand_vals: Tensor, cand_ids: Tensor, threshold: Tensor, cand_weights: Tensor,
    cand_token_ids: Tensor, generator: torch.Generator,
) -> Tensor:
    """Exact sampling for unseeded rows whose support may be wider than the
    candidates: pick "a candidate" with the candidates' share of the mass (one
    uniform per row), keeping that row's candidate race `cand_token_ids` [N], else
    race among the other tokens. A row whose support fits the candidates always
    keeps its candidate (no other mass). x [N, V] (tempered, edited in place),
    cand_vals / cand_ids / cand_weights [N, C]."""
    if _any(threshold > float("-inf")):
        x.masked_fill_(x < threshold, float("-inf"))
    # [N, V], candidates excluded (a tensor of zeros scatters ~3x faster on CPU than a scalar)
    rest = x.sub_(cand_vals[:, :1]).exp_().scatter_(1, cand_ids, torch.zeros_like(cand_weights))
    cand_mass = cand_weights.sum(dim=-1)
    uniform = _fill_uniform(torch.empty(len(x), dtype=x.dtype, device=x.device), generator)
    # NOTE: u < 1, so with no other mass u * cand_mass < cand_mass: the candidate is kept.
    pick_candidate = uniform * (cand_mass + rest.sum(dim=-1)) < cand_mass  # [N]
    leaving = _rows_where(~pick_candidate)  # all rows where the host cannot read it
    token_ids = cand_token_ids.clone()
    if leaving is not None:
        rest = rest[leaving]  # [Nt, V]
        rest_token_ids = rest.div_(_exp_noise(rest.shape, rest.dtype, generator, rest.device)).argmax(dim=-1)
        token_ids[leaving] = torch.where(pick_candidate[leaving], cand_token_ids[leaving], rest_token_ids)
    return token_ids


def _race_full(x: Tensor, threshold: Tensor, generators: Sequence[torch.Generator]) -> Tensor:
    """Exponential race over the whole vocab for seeded rows: x [N, V]
    (tempered, edited in place); row j draws exactly one noise vector [V]
    from generators[j], so its token depends on nothing else in the batch."""
    x.masked_fill_(x < threshold, float("-inf"))
    weights = x.sub_(x.max(dim=-1, keepdim=True).values).exp_()  # [N, V]
    uniform = torch.empty_like(weights)
    for j, generator in enumerate(generators):
        _fill_uniform(uniform[j], generator)
    return weights.div_(uniform.log_().neg_()).argmax(dim=-1)


def apply_logit_edits(x: Tensor, batch: SamplingBatch, last_token_ids: Tensor | None = None) -> None:
    """Every per-row edit of the logits x [S, V] before the draw, in place, in the module
    docstring's order; each touches only its own rows, so a row's logits are those it
    would have alone. `last_token_ids` [S]: the token each row was fed this step."""
    if batch.penalty_rows is not None:
        apply_repetition_penalty(x, batch, last_token_ids)
    if batch.output_penalty_rows is not None:
        _apply_output_penalties(x, batch, last_token_ids)
    if batch.bias_rows is not None:
        # Accumulating: a pad repeats the row's first id with bias 0.
        x.index_put_((batch.bias_rows[:, None], batch.bias_token_ids), batch.bias_values.to(x.dtype),
                     accumulate=True)
    if batch.allowed_rows is not None:
        mask = x.new_full((len(batch.allowed_rows), x.shape[1]), float("-inf"))
        mask.scatter_(1, batch.allowed_token_ids, 0.0)  # [A, V]: 0 where allowed
        x[batch.allowed_rows] += mask
    if batch.banned_rows is not None:
        _ban_ids(x, batch, last_token_ids)


def _apply_output_penalties(x: Tensor, batch: SamplingBatch, last_token_ids: Tensor | None) -> None:
    """OpenAI's penalties, in place on x [S, V]: a token generated c times by its row
    loses c * frequency_penalty + (c > 0) * presence_penalty."""
    rows = batch.output_penalty_rows
    token_ids = batch.output_token_ids  # [Q, L]: -1 padding, PENDING_OUTPUT on the device
    if last_token_ids is not None:
        token_ids = torch.where(token_ids == PENDING_OUTPUT, last_token_ids[rows][:, None], token_ids)
    counts = torch.zeros(len(rows), x.shape[1], dtype=x.dtype, device=x.device)  # [Q, V]
    counts.scatter_add_(1, token_ids.clamp(min=0), (token_ids >= 0).to(x.dtype))
    frequency = batch.frequency_penalty.to(x.dtype)[:, None]
    presence = batch.presence_penalty.to(x.dtype)[:, None]
    x[rows] -= counts * frequency + (counts > 0).to(x.dtype) * presence


def _ban_ids(x: Tensor, batch: SamplingBatch, last_token_ids: Tensor | None) -> None:
    """Mask the banned ids to -inf: each where its condition holds (none, or the row's last
    token). Accumulating -inf or 0, so a repeated (row, id) with either is the same."""
    token_ids = batch.banned_token_ids  # [B, M], a pad repeats the row's first entry
    conditions = batch.ban_conditions
    if conditions is None:
        _mask_ids(x, batch.banned_rows, token_ids, float("-inf"))
        return
    assert last_token_ids is not None, "conditional bans read the rows' last tokens"
    holds = (conditions < 0) | (conditions == last_token_ids[batch.banned_rows][:, None])  # [B, M]
    values = torch.where(holds, float("-inf"), 0.0).to(x.dtype)
    x.index_put_((batch.banned_rows[:, None], token_ids), values, accumulate=True)


def apply_repetition_penalty(x: Tensor, batch: SamplingBatch, last_token_ids: Tensor | None = None) -> None:
    """Hugging Face RepetitionPenaltyLogitsProcessor, in place on x [S, V], on the
    rows with a penalty: each token a row has seen has its logit divided by the
    penalty if positive, else multiplied, once however often it was seen. Seen:
    its history, and its last token `last_token_ids` [S] when given (the token it
    was fed this step, which the host history may hold as PENDING_TOKEN)."""
    if batch.penalty_rows is None:
        return
    rows = batch.penalty_rows[:, None]  # [P, 1]
    token_ids = batch.seen_token_ids  # [P, L], -1 where unknown
    fill = token_ids[:, :1]  # the prompt's first id, seen (-1 when the row has no history)
    if last_token_ids is not None:
        fill = last_token_ids[batch.penalty_rows][:, None]
        token_ids = torch.cat([token_ids, fill], dim=1)  # [P, L + 1]
    # Unknown ids read and write a seen id of the row again: one value per (row, id).
    token_ids = torch.where(token_ids < 0, fill, token_ids)
    penalty = torch.where(token_ids >= 0, batch.repetition_penalty.to(x.dtype)[:, None], 1.0)
    token_ids = token_ids.clamp(min=0)  # a row that saw nothing writes x[row, 0] unchanged
    seen = x[rows, token_ids]  # [P, L]
    x[rows, token_ids] = torch.where(seen < 0, seen * penalty, seen / penalty)


def _top_p_threshold(
    cand_vals: Tensor, threshold: Tensor, top_p: Tensor, nucleus: Tensor | None, row_local: bool
) -> Tensor:
    """Per-row logit threshold [N, 1] of the nucleus: the smallest set of most
    likely tokens (among those >= `threshold`, i.e. after top-k) whose mass
    >= top_p. Rows with top_p == 1 get -inf (off). cand_vals [N, C] are the
    tempered top-C logits, descending; `nucleus` [T, V] the tempered logits of
    the first T rows (top-p without top-k: their nucleus may pass the candidates;
    every other row's survivors are candidates), None when C = V.

    Masses are exp(x - row max), unnormalized. With `row_local` (seeded rows)
    every sum is a scan of one row (`_cumsum_rows`), so the result does not
    depend on the batch (ATen splits a lone row's sum across threads)."""
    num_candidates = cand_vals.shape[1]
    row_max = cand_vals[:, :1]  # [N, 1]
    cum = _cumulative_mass(cand_vals, row_max, threshold, row_local)  # [N, C]
    total = cum[:, -1]  # [N]: all the mass on top-k rows (every survivor is a candidate)
    num_nucleus = 0 if nucleus is None else len(nucleus)
    if num_nucleus:
        weights = (nucleus - row_max[:num_nucleus]).exp_()  # [T, V]; no top-k: all count
        full = _cumsum_rows(weights, row_local)[:, -1] if row_local else weights.sum(dim=-1)
        total = torch.cat([full, total[num_nucleus:]])
    target = (top_p * total)[:, None]  # [N, 1]
    rank = torch.searchsorted(cum, target)[:, 0]  # first rank whose mass reaches top_p
    cutoff = cand_vals.gather(1, rank.clamp(max=num_candidates - 1)[:, None])
    if num_nucleus:
        wider = _rows_where(rank[:num_nucleus] >= num_candidates)  # nucleus past the candidates
        if wider is not None:
            sorted_vals = _sort_descending(nucleus[wider])  # [W, V]
            cum = _cumulative_mass(sorted_vals, row_max[wider], threshold[wider], row_local)
            rank = torch.searchsorted(cum, target[wider])[:, 0].clamp(max=nucleus.shape[1] - 1)
            cutoff[wider] = sorted_vals.gather(1, rank[:, None])
    return torch.where(top_p[:, None] < 1, cutoff, float("-inf"))


def _cumulative_mass(sorted_vals: Tensor, row_max: Tensor, threshold: Tensor, row_local: bool) -> Tensor:
    """Inclusive cumulative exp(x - row_max) [N, K] over values sorted
    descending, counting only values >= threshold; non-decreasing."""
    mass = (sorted_vals - row_max).exp_()
    if _any(threshold > float("-inf")):
        mass.masked_fill_(sorted_vals < threshold, 0.0)
    return _cumsum_rows(mass, row_local)


def _cumsum_rows(mass: Tensor, row_local: bool) -> Tensor:
    """Inclusive cumsum along each row of mass [N, K] (in place on CPU). With
    `row_local`, each row's sums depend on that row alone, run after run."""
    if not row_local or mass.device.type == "cpu":
        return mass.cumsum_(dim=-1)  # NOTE: ATen's CPU scan is sequential per row
    # CUDA sizes its per-row scan by the number of rows, and scans a lone row with
    # cub, whose float sums vary run to run: each row is scanned as one of two.
    return torch.stack([torch.stack([row, row]).cumsum(dim=-1)[0] for row in mass])


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
    token, or what an earlier attempt streamed). One draw at a time on the generator's
    device, as sampling makes them, so the generator ends in the same state."""
    dtype = torch.float64 if logits_dtype == torch.float64 else torch.float32
    noise = torch.empty(vocab_size, dtype=dtype, device=generator.device)
    for _ in range(num_draws):
        _fill_uniform(noise, generator)


def _fill_uniform(out: Tensor, generator: torch.Generator) -> Tensor:
    """U[0, 1) into `out` from `generator` (on out's device); the values depend only
    on the generator's state and out's shape, not on where `out` lives in memory."""
    return out.uniform_(generator=generator)


def _mask_ids(x: Tensor, rows: Tensor, token_ids: Tensor, value: float) -> None:
    """x[rows[i], token_ids[i, j]] = value; token_ids [B, M], a pad repeats its row's first id."""
    # NOTE: the value as a device tensor: a Python scalar would be copied to a CUDA device
    # with a blocking copy (index_put_ moves a CPU value to the tensor's device).
    x.index_put_((rows[:, None], token_ids), x.new_full((), value))


def _logprobs(
    logits: Tensor, dtype: torch.dtype, token_ids: Tensor, batch: SamplingBatch
) -> tuple[Tensor, Tensor, Tensor]:
    """For the rows that asked, from the raw logits [S, V]: the sampled tokens'
    logprobs [L] and the top-n logprobs and ids [L, n], descending."""
    rows = batch.logprob_rows
    if rows is not None:
        logits, token_ids = logits[rows], token_ids[rows]
    logprobs = logits.to(dtype).log_softmax(dim=-1)  # [L, V]
    top_vals, top_ids = logprobs.topk(batch.max_num_logprobs, dim=-1)  # [L, N], descending
    return logprobs.gather(1, token_ids[:, None])[:, 0], top_vals, top_ids


def _start_copy(
    token_ids: Tensor, logprobs: tuple[Tensor, ...], num_logprobs: tuple[int | None, ...]
) -> SampledTokens:
    """SampledTokens with the copy of its tensors to the host started: on CUDA,
    non-blocking into pinned memory, then an event; elsewhere nothing to start
    (CPU tensors are on the host already)."""
    tensors = (token_ids, *logprobs)
    host, copied = tensors, None
    if token_ids.device.type == "cuda":
        host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                     for t in tensors)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(token_ids.device))
    sampled, top_vals, top_ids = logprobs if logprobs else (None, None, None)
    return SampledTokens(token_ids, sampled, top_vals, top_ids, num_logprobs, host, copied)

"""Per-request sampling parameters, shaped like vLLM's `SamplingParams`."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, replace

from engine.structured_output import StructuredOutput

# Temperatures below this are treated as greedy (as vLLM does): dividing logits
# by ~0 overflows, and the result would be argmax anyway.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_NUM_LOGPROBS = 20
# OpenAI's bounds: penalties in [-2, 2], at most 300 biases each in [-100, 100].
MAX_ABS_PENALTY = 2.0
MAX_NUM_LOGIT_BIAS = 300
MAX_ABS_LOGIT_BIAS = 100.0
MAX_N = 128  # OpenAI's bound on choices per request


def length_limit(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
    """The length rule: a request ends by length once it holds this many tokens, prompt and
    output (its max_tokens generated, or max_model_len reached). Every check of it asks here
    (Request.max_num_tokens for a request): the stop check, the scheduler's peak KV, how
    many tokens a row may propose, and the gateway's check of a request that moved."""
    return min(num_prompt_tokens + max_tokens, max_model_len)


class SamplingParamError(ValueError):
    """A SamplingParams attribute holds a value it cannot take; `name` is the attribute,
    so that a server can tell its caller which field of its request is at fault."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns logits into tokens and when it stops.

    Sampling (applied in this order by the sampler):
    - `repetition_penalty`: Hugging Face semantics over prompt + generated
      tokens: a seen token's positive logit is divided by the penalty, a
      negative one multiplied. 1.0 = off.
    - `frequency_penalty`, `presence_penalty` (OpenAI's, in [-2, 2], 0 = off),
      over generated tokens only: a token generated c times has
      c * frequency_penalty + (c > 0) * presence_penalty subtracted from its logit.
    - `logit_bias`: {token id: bias in [-100, 100]} added to the logits (at most
      300 entries; normalized to a tuple of (id, bias) pairs sorted by id).
    - `allowed_token_ids`: only these ids may be sampled (None = all).
    - `bad_words`: strings never generated: the engine tokenizes each (with and
      without a leading space); a one-token word is always masked, a longer one's
      last token is masked where the output ends with the rest of it.
    - `structured_output`: the output must match a JSON schema, any JSON object,
      a regex, one of some strings or a grammar (engine.structured_output).
    - `temperature`: 0 (below 1e-5) means greedy; otherwise logits / temperature.
    - `top_k`: keep the k most likely tokens; 0 or -1 = off (normalized to 0).
    - `top_p`: keep the smallest set of most likely tokens whose mass >= top_p.
    - `min_p`: drop tokens whose probability < min_p * the top probability.
    - `seed`: a seeded request draws only from its own generator, so its output
      does not depend on what else is in the batch. The generator lives on the
      engine's device: output is reproducible on one device type, but CPU and
      GPU generators draw different noise, so the same seed may give other
      tokens on a GPU than on a CPU.

    Stopping:
    - `max_tokens`: generated tokens at most (>= 1).
    - `min_tokens`: EOS and `stop_token_ids` are suppressed until this many
      tokens were generated (not under a structured output: its grammar decides
      where the output may end).
    - `stop`: strings that end generation when they appear in the output text.
    - `stop_token_ids`: token ids that end generation (besides EOS).
    - `ignore_eos`: keep generating past EOS.

    Output:
    - `n`: choices per request (1..128), each its own sequence: the gateway (and
      `LLM.generate`) runs the prompt's prefill once and the other choices from the
      prefix cache; a seeded request's choice i draws from seed + i. An engine runs one
      sequence a request (n = 1).
    - `logprobs`: None = none; n >= 0 = the sampled token's logprob plus the
      top-n (token_id, logprob) pairs per step (0..20).
    - `prompt_logprobs`: None = none; k >= 0 = each prompt token's logprob (but the
      first's) and the top-k alternatives at its position (0..20), with the first
      answer. Such a prompt is prefilled in full: the prefix cache is not read for it.
    - `include_stop_str_in_output`, `skip_special_tokens`: detokenizer options.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = None
    allowed_token_ids: list[int] | tuple[int, ...] | None = None
    bad_words: list[str] | tuple[str, ...] | None = None
    structured_output: StructuredOutput | None = None
    n: int = 1
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        self._check_numbers()
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise SamplingParamError("structured_output",
                                     f"structured_output must be a StructuredOutput, got {self.structured_output!r}")
        self._normalize()

    def _check_numbers(self) -> None:
        """Each number's type and range; SamplingParamError naming the first that is wrong."""
        _check_real("temperature", self.temperature)
        if self.temperature < 0:
            raise SamplingParamError("temperature", f"temperature must be >= 0, got {self.temperature}")
        _check_real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise SamplingParamError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise SamplingParamError("top_k", f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        _check_real("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise SamplingParamError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _check_real("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise SamplingParamError("repetition_penalty",
                                     f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.seed is not None:
            _check_int("seed", self.seed)
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise SamplingParamError("max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise SamplingParamError("min_tokens",
                                     f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not 0 <= value <= MAX_NUM_LOGPROBS:
                    raise SamplingParamError(name, f"{name} must be in [0, {MAX_NUM_LOGPROBS}], got {value}")
        _check_int("n", self.n)
        if not 1 <= self.n <= MAX_N:
            raise SamplingParamError("n", f"n must be in [1, {MAX_N}], got {self.n}")
        if self.seed is not None and not -(2**63) <= self.seed <= 2**63 - self.n:
            # choice i draws from seed + i, a 64-bit seed on the wire too
            raise SamplingParamError("seed", f"seed must be in [-2^63, 2^63 - n], got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_real(name, getattr(self, name))
            if abs(getattr(self, name)) > MAX_ABS_PENALTY:
                raise SamplingParamError(name, f"{name} must be in [-2, 2], got {getattr(self, name)}")

    def _normalize(self) -> None:
        """Plain Python numbers (numpy scalars are accepted), and lists in one form."""
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))
        for name in ("max_tokens", "min_tokens", "seed", "logprobs", "n", "prompt_logprobs"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "top_k", 0 if self.top_k == -1 else int(self.top_k))
        object.__setattr__(self, "stop", _normalize_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalize_ids(self.stop_token_ids, "stop_token_ids"))
        object.__setattr__(self, "logit_bias", _normalize_logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            allowed = _normalize_ids(self.allowed_token_ids, "allowed_token_ids")
            if not allowed:
                raise SamplingParamError("allowed_token_ids", "allowed_token_ids is empty: no token could be sampled")
            object.__setattr__(self, "allowed_token_ids", allowed)
        object.__setattr__(self, "bad_words", _normalize_strings(self.bad_words, "bad_words"))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def choice(self, index: int) -> SamplingParams:
        """Choice `index` of an n > 1 request as a request of its own: n = 1, seed + index,
        and the prompt's logprobs asked of choice 0 only (the others read the prefix cache)."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index,
                       prompt_logprobs=self.prompt_logprobs if index == 0 else None)

    @property
    def has_output_penalty(self) -> bool:
        """Whether the OpenAI penalties (over generated tokens) are on."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def token_id_fields(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """Every token id the request names, by field, for the vocabulary check the
        engine (and the gateway, ahead of it) makes before an id reaches a tensor."""
        return (("stop_token_ids", self.stop_token_ids),
                ("logit_bias", tuple(token_id for token_id, _ in self.logit_bias)),
                ("allowed_token_ids", self.allowed_token_ids or ()))


def _check_real(name: str, value: object) -> None:
    if type(value) is float or type(value) is int:  # the common case, without the ABC check
        if not math.isfinite(value):
            raise SamplingParamError(name, f"{name} must be finite, got {value}")
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SamplingParamError(name, f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise SamplingParamError(name, f"{name} must be finite, got {value}")


def _check_int(name: str, value: object) -> None:
    if type(value) is int:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise SamplingParamError(name, f"{name} must be an int, got {value!r}")


def _normalize_stop(stop: object) -> tuple[str, ...]:
    if isinstance(stop, str):
        return (stop,) if stop else _normalize_strings([stop], "stop")
    return _normalize_strings(stop, "stop")


def _normalize_strings(strings: object, name: str) -> tuple[str, ...]:
    if strings is None:
        return ()
    if isinstance(strings, str) or not isinstance(strings, (list, tuple)):
        raise SamplingParamError(name, f"{name} must be a list of str, got {strings!r}")
    strings = tuple(strings)
    for s in strings:
        if not isinstance(s, str) or not s:
            raise SamplingParamError(name, f"{name} strings must be non-empty str, got {s!r}")
    return strings


def _is_token_id(value: object) -> bool:
    return type(value) is int or (not isinstance(value, bool) and isinstance(value, numbers.Integral))


def _normalize_ids(ids: object, name: str) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise SamplingParamError(name, f"{name} must be a list of token ids, got {ids!r}")
    ids = tuple(ids)
    for token_id in ids:
        if not _is_token_id(token_id) or token_id < 0:
            raise SamplingParamError(name, f"{name} must be non-negative ints, got {token_id!r}")
    return tuple(int(token_id) for token_id in ids)


def _normalize_logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """{id: bias} or (id, bias) pairs as pairs sorted by id; keys may be digit strings
    (JSON objects have string keys, as OpenAI's logit_bias does)."""
    if bias is None:
        return ()
    if isinstance(bias, Mapping):
        pairs = list(bias.items())
    elif isinstance(bias, (list, tuple)) and all(isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in bias):
        pairs = list(bias)
    else:
        raise SamplingParamError("logit_bias", f"logit_bias must map token ids to numbers, got {bias!r}")
    if len(pairs) > MAX_NUM_LOGIT_BIAS:
        raise SamplingParamError("logit_bias", f"logit_bias has {len(pairs)} entries, at most {MAX_NUM_LOGIT_BIAS}")
    normalized = {}
    for token_id, value in pairs:
        if isinstance(token_id, str) and token_id.isascii() and token_id.isdigit():
            token_id = int(token_id)
        if not _is_token_id(token_id) or token_id < 0:
            raise SamplingParamError("logit_bias", f"logit_bias keys must be non-negative token ids, got {token_id!r}")
        _check_real("logit_bias", value)
        if abs(value) > MAX_ABS_LOGIT_BIAS:
            raise SamplingParamError("logit_bias", f"logit_bias values must be in [-100, 100], got {value}")
        normalized[int(token_id)] = float(value)
    return tuple(sorted(normalized.items()))

"""Per-request sampling parameters, shaped like vLLM's `SamplingParams`."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

# Temperatures below this are treated as greedy (as vLLM does): dividing logits
# by ~0 overflows, and the result would be argmax anyway.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_NUM_LOGPROBS = 20


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
      tokens were generated.
    - `stop`: strings that end generation when they appear in the output text.
    - `stop_token_ids`: token ids that end generation (besides EOS).
    - `ignore_eos`: keep generating past EOS.

    Output:
    - `logprobs`: None = none; n >= 0 = the sampled token's logprob plus the
      top-n (token_id, logprob) pairs per step (0..20).
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

    def __post_init__(self) -> None:
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
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
            if not 0 <= self.logprobs <= MAX_NUM_LOGPROBS:
                raise SamplingParamError("logprobs",
                                         f"logprobs must be in [0, {MAX_NUM_LOGPROBS}], got {self.logprobs}")
        # Plain Python numbers from here on (numpy scalars are accepted above).
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))
        for name in ("max_tokens", "min_tokens", "seed", "logprobs"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        object.__setattr__(self, "top_k", 0 if self.top_k == -1 else int(self.top_k))
        object.__setattr__(self, "stop", _normalize_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalize_ids(self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS


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
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else _normalize_stop([stop])
    if not isinstance(stop, (list, tuple)):
        raise SamplingParamError("stop", f"stop must be a str or a list of str, got {stop!r}")
    stop = tuple(stop)
    for s in stop:
        if not isinstance(s, str) or not s:
            raise SamplingParamError("stop", f"stop strings must be non-empty str, got {s!r}")
    return stop


def _normalize_ids(ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    ids = tuple(ids)
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral) or token_id < 0:
            raise SamplingParamError("stop_token_ids", f"stop_token_ids must be non-negative ints, got {token_id!r}")
    return tuple(int(token_id) for token_id in ids)

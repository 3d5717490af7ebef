"""Structured output with llguidance: a request's constraint (engine.structured_output)
compiled against the model's vocabulary, one matcher per request, and the token bitmask
the sampler applies.

llguidance (MIT, no dependencies, one abi3 wheel) rather than xgrammar: its compile is
bounded by `LLParserLimits` fuel, so a hostile schema or regex fails in milliseconds
with an error, where xgrammar's compile of a large schema ran on with no way to stop it
(docs/sampling.md gives what we measured); and its compact JSON holds for any-JSON too.
Masks are computed lazily per step.

Compiling happens off the engine's step: `GrammarCompiler.prepare` (thread-safe, cached
by constraint) validates the grammar and builds a template matcher, called from a worker
thread by the async engine before the request reaches the engine thread; the engine then
only copies the template (`new_state`). A request's matcher is rebuilt from its tokens
wherever it lands (a handoff's decode worker, a worker it moved to after a crash).
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from engine.errors import first_line
from engine.structured_output import StructuredOutput, StructuredOutputError

# Whitespace a pretty JSON output may put between two tokens: a newline and an indent of
# up to 16, or one space. Compact output allows none.
PRETTY_WHITESPACE = r"(\n {0,16})?| ?"
MAX_CACHED_GRAMMARS = 256
BITS = 32


def _limits():
    import llguidance

    # Tighter than llguidance's defaults where a request could make a step slow: a mask
    # step's lexer fuel (~14k/ms) and Earley items (~20k/ms) bound it to a few ms.
    return llguidance.LLParserLimits(step_lexer_fuel=50_000, step_max_items=20_000, max_grammar_size=200_000,
                                     verbose_errors=False)


def grammar_text(spec: StructuredOutput) -> str:
    """The constraint as an llguidance grammar definition (ValueError if malformed)."""
    import llguidance

    kind = spec.kind
    if kind in ("json_schema", "json_object"):
        try:
            schema = json.loads(spec.json_schema) if kind == "json_schema" else {"type": "object"}
        except json.JSONDecodeError as error:
            raise StructuredOutputError("json_schema", f"json_schema is no JSON: {error}") from None
        if not isinstance(schema, (dict, bool)):
            raise StructuredOutputError("json_schema", "json_schema must be a JSON object")
        defaults = {"whitespace_pattern": PRETTY_WHITESPACE} if spec.pretty_json else {"whitespace_flexible": False}
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=defaults)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(list(spec.choice)))
    return llguidance.grammar_from("grammar", spec.grammar)  # Lark, or GBNF (`root ::= ...`)


class GrammarCompiler:
    """Compiles constraints for one model's vocabulary; thread-safe, cached by constraint."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width: ids past the tokenizer's are masked
        self._lock = threading.Lock()
        self._tokenizer = None  # llguidance's, built at first use (costly: docs/sampling.md)
        self._templates: OrderedDict[tuple, object] = OrderedDict()

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
            return self._tokenizer

    def prepare(self, spec: StructuredOutput):
        """The constraint's template matcher, compiled (once: cached); StructuredOutputError
        naming the field for a constraint that is malformed or over llguidance's limits."""
        key = spec.key
        with self._lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
                return template
        import llguidance

        tokenizer = self._llg_tokenizer()
        try:
            text = grammar_text(spec)
        except StructuredOutputError:
            raise
        except (ValueError, TypeError, RuntimeError) as error:
            raise StructuredOutputError(spec.kind, f"{spec.kind}: {first_line(error, 300)}") from None
        limits = _limits()
        error = llguidance.LLMatcher.validate_grammar(text, tokenizer, limits=limits)
        if error:
            raise StructuredOutputError(spec.kind, f"{spec.kind} cannot be used: {first_line(error, 300)}")
        template = llguidance.LLMatcher(tokenizer, text, limits=limits, log_level=0)
        if not template.is_error():
            # The first mask here, not in a step: it builds the lexer states every copy then
            # shares, and finds a regex whose lexer would grow past the limits.
            from llguidance.torch import fill_next_token_bitmask

            fill_next_token_bitmask(template, torch.empty(1, bitmask_words(self.vocab_size), dtype=torch.int32), 0)
        if template.is_error():
            raise StructuredOutputError(spec.kind, f"{spec.kind} cannot be used: {first_line(template.get_error(), 300)}")
        with self._lock:
            self._templates[key] = template
            while len(self._templates) > MAX_CACHED_GRAMMARS:
                self._templates.popitem(last=False)
        return template

    def new_state(self, spec: StructuredOutput, generated: Sequence[int] = ()) -> GrammarState:
        """A request's matcher, advanced past the tokens it generated before (elsewhere, or
        before a move); StructuredOutputError if they do not match the constraint."""
        state = GrammarState(self.prepare(spec).deep_copy())
        for token_id in generated:
            if not state.accept(token_id):
                raise StructuredOutputError("structured_output",
                                            f"the tokens generated so far do not match the {spec.kind}")
        return state


class GrammarState:
    """One request's matcher: which tokens may come next, and whether its output is done."""

    __slots__ = ("matcher",)

    def __init__(self, matcher) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the constraint does not allow it."""
        return self.matcher.consume_token(token_id)

    @property
    def is_done(self) -> bool:
        """Whether nothing may follow: the output is complete (EOS consumed, or no token could
        extend it), or the matcher failed (a mask step over llguidance's limits): the
        request then ends where it is."""
        return self.matcher.is_stopped() or self.matcher.is_error()


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + BITS - 1) // BITS


_EXECUTOR = []  # llguidance's thread pool, made at first use


def _executor():
    if not _EXECUTOR:
        import llguidance

        _EXECUTOR.append(llguidance.LLExecutor(num_threads=max(1, min(8, (os.cpu_count() or 2) - 1))))
    return _EXECUTOR[0]


def fill_bitmask(states: Sequence[GrammarState], num_words: int, device: torch.device) -> Tensor:
    """The rows' next-token bitmask [G, W] int32, filled on the host (several rows at once on
    llguidance's threads, the GIL released) and copied to `device` without waiting (from
    pinned memory on CUDA)."""
    from llguidance.torch import fill_next_token_bitmask_par

    host = torch.empty(len(states), num_words, dtype=torch.int32, pin_memory=device.type == "cuda")
    live = [(state.matcher, row) for row, state in enumerate(states) if not state.is_done]
    if live:
        fill_next_token_bitmask_par(_executor(), live, host)
    for row, state in enumerate(states):
        # Ended (before or in this step's mask): whatever is sampled reaches no one, and a
        # matcher that failed now ends the request after this step (scheduler.resolve).
        if state.is_done:
            host[row].fill_(-1)
    return host.to(device, non_blocking=True)


_POWERS: dict[torch.device, Tensor] = {}


def apply_bitmask(x: Tensor, rows: Tensor, bitmask: Tensor) -> None:
    """x[rows[i], t] = -inf where bit t of bitmask[i] is clear, in place on x [S, V]; ids
    past the bitmask's width are masked too."""
    powers = _POWERS.get(x.device)
    if powers is None:
        powers = torch.from_numpy((np.int64(1) << np.arange(BITS)).astype(np.uint32).view(np.int32))
        powers = _POWERS.setdefault(x.device, powers.to(x.device))
    vocab_size = x.shape[1]
    blocked = ((bitmask[:, :, None] & powers) == 0).view(len(bitmask), -1)  # [G, W * 32]
    if blocked.shape[1] < vocab_size:
        blocked = torch.nn.functional.pad(blocked, (0, vocab_size - blocked.shape[1]), value=True)
    x[rows] = x[rows].masked_fill(blocked[:, :vocab_size], float("-inf"))

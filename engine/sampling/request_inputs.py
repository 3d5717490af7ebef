"""What the engine checks and derives from a new request's inputs before it is queued:
every token id it names inside the vocabulary, its bad words as token ids, its grammar's
matcher. Errors are InvalidRequestError naming the request attribute at fault."""

from __future__ import annotations

from collections.abc import Sequence

from engine.request import InvalidRequestError, Request
from engine.sampling.grammar import GrammarCompiler
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputError


def first_outside_vocab(token_ids: Sequence[int], vocab_size: int) -> int | None:
    """The position of the first id outside [0, vocab_size); None if there is none."""
    if min(token_ids) >= 0 and max(token_ids) < vocab_size:
        return None
    return next(i for i, token_id in enumerate(token_ids) if not 0 <= token_id < vocab_size)


def check_token_ids(name: str, token_ids: Sequence[int], vocab_size: int, is_list: bool = True) -> None:
    """InvalidRequestError naming attribute `name` (and the position, if `is_list`) of the
    first id outside the vocabulary."""
    index = first_outside_vocab(token_ids, vocab_size)
    if index is not None:
        raise InvalidRequestError(name, f"token id {token_ids[index]} is outside the vocabulary [0, {vocab_size})",
                                  index if is_list else None)


def check_sampling_ids(params: SamplingParams, vocab_size: int) -> None:
    """Every id the sampling parameters name, before any reaches a tensor (an id past the
    vocabulary would index another row's logits, or fault the device); and n = 1."""
    if params.n != 1:
        raise InvalidRequestError("sampling_params.n", "an engine runs one sequence a request: n > 1 is the "
                                  "gateway's (or LLM.generate's), which sends each choice as a request")
    for name, token_ids in params.token_id_fields():
        if token_ids:
            bad = first_outside_vocab(token_ids, vocab_size)
            if bad is not None:
                # logit_bias is a map on the wire: its entry at fault is named by key.
                raise InvalidRequestError(f"sampling_params.{name}", f"token id {token_ids[bad]} is outside the "
                                          f"vocabulary [0, {vocab_size})",
                                          token_ids[bad] if name == "logit_bias" else bad)


def bad_word_ids(tokenizer, bad_words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Each bad word as token ids, alone and after a space (as vLLM tokenizes them: the same
    word mid-sentence is usually other tokens)."""
    if tokenizer is None:
        raise InvalidRequestError("sampling_params.bad_words", "this model has no tokenizer: bad_words cannot be "
                                  "tokenized")
    sequences: dict[tuple[int, ...], None] = {}
    for word in bad_words:
        for text in (word.lstrip(), " " + word.lstrip()):
            token_ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if token_ids:
                sequences[token_ids] = None
    return tuple(sequences)


def start_grammar(grammars: GrammarCompiler | None, request: Request) -> None:
    """A constrained request's matcher, past the tokens generated for it so far (by the
    prefill worker, or by a worker it moved from)."""
    spec = request.sampling_params.structured_output
    if spec is None:
        return
    if grammars is None:
        raise InvalidRequestError("sampling_params.structured_output",
                                  "this model has no tokenizer: structured output needs one")
    try:
        request.grammar = grammars.new_state(spec, request.generated_token_ids)
    except StructuredOutputError as error:
        raise InvalidRequestError(f"sampling_params.{error.name}", str(error)) from None

"""What one request may carry, in one place: the gateway checks all of it
(gateway/prepare.py), and each worker checks what reaches it (`check_sampling`, from
baton/wire/convert.py), so that a call straight to a worker's internal port is held
to the same bounds (20,000 bad words sent to a decode worker stalled its other streams
while the engine thread tokenized them). Beyond these a request is
refused before it costs anything (INVALID_ARGUMENT naming the field, OUT_OF_RANGE for a
prompt longer than the model's context, RESOURCE_EXHAUSTED from grpc for a message over
MAX_REQUEST_BYTES). The ranges of the sampling values themselves (temperature >= 0,
top_p in (0, 1], logprobs in 0..20, min_tokens <= max_tokens, finite floats, ...) are
the engine's SamplingParams'; these bound what would only cost the server (vLLM and
TGI refuse the same kinds of requests)."""

from __future__ import annotations

from baton.wire.records import FieldError
from engine.sampling_params import SamplingParams

# A request's serialized size on the public port. A prompt of a 128k-token context is
# at most about 640 KB as token ids, and rarely 1 MB as text; grpc refuses anything
# larger with RESOURCE_EXHAUSTED before it is parsed (the internal ports allow 64 MB).
MAX_REQUEST_BYTES = 8 * 1024 * 1024

MAX_REQUEST_ID_LENGTH = 256  # printable characters: it goes into logs and traces

# Characters of prompt text (or of all chat contents) per token of the model's context
# that the gateway will tokenize at most: far past any real tokenizer's average, so no
# prompt that could fit is refused, while a prompt far too long for the context is
# refused before it costs seconds of tokenizing.
MAX_CHARS_PER_TOKEN = 32

CHAT_ROLES = ("system", "user", "assistant")
MAX_NUM_MESSAGES = 1024

# Stop strings are matched against every new piece of text of the request.
MAX_NUM_STOP = 16
MAX_STOP_LENGTH = 256  # characters
MAX_NUM_STOP_TOKEN_IDS = 256

# Priorities are offsets in scheduling order; beyond this they order nothing more.
MAX_ABS_PRIORITY = 1_000_000

# Token-id lists the sampler turns into masks: each id costs a scatter per step.
MAX_NUM_ALLOWED_TOKEN_IDS = 65_536
MAX_NUM_BAD_WORDS = 64
MAX_BAD_WORD_LENGTH = 256  # characters

# A structured-output constraint's text (schema, regex, grammar, or all choices together):
# it compiles against the whole vocabulary. Real schemas (tool definitions included) are
# a few kB; compiling one of this size already takes seconds.
MAX_CONSTRAINT_BYTES = 64 * 1024
MAX_NUM_CHOICES = 256


def check_sampling(params: SamplingParams, field: str = "sampling") -> None:
    """The bounds on a request's sampling lists and texts; FieldError naming the first
    field at fault (under `field`: "sampling", or a worker's "request.sampling")."""
    if len(params.stop) > MAX_NUM_STOP:
        raise FieldError(f"{field}.stop", f"more than {MAX_NUM_STOP} stop strings")
    for index, stop in enumerate(params.stop):
        if len(stop) > MAX_STOP_LENGTH:
            raise FieldError(f"{field}.stop[{index}]", f"stop string longer than {MAX_STOP_LENGTH} characters")
    if len(params.stop_token_ids) > MAX_NUM_STOP_TOKEN_IDS:
        raise FieldError(f"{field}.stop_token_ids", f"more than {MAX_NUM_STOP_TOKEN_IDS} stop token ids")
    if params.allowed_token_ids is not None and len(params.allowed_token_ids) > MAX_NUM_ALLOWED_TOKEN_IDS:
        raise FieldError(f"{field}.allowed_token_ids", f"more than {MAX_NUM_ALLOWED_TOKEN_IDS} allowed token ids")
    if len(params.bad_words) > MAX_NUM_BAD_WORDS:
        raise FieldError(f"{field}.bad_words", f"more than {MAX_NUM_BAD_WORDS} bad words")
    for index, word in enumerate(params.bad_words):
        if len(word) > MAX_BAD_WORD_LENGTH:
            raise FieldError(f"{field}.bad_words[{index}]", f"bad word longer than {MAX_BAD_WORD_LENGTH} characters")
    structured = params.structured_output
    if structured is not None:
        kind = structured.kind
        if kind == "choice" and len(structured.choice) > MAX_NUM_CHOICES:
            raise FieldError(f"{field}.choice", f"more than {MAX_NUM_CHOICES} choices")
        text = "".join(structured.choice) if kind == "choice" else getattr(structured, kind)
        if kind != "json_object" and len(text.encode()) > MAX_CONSTRAINT_BYTES:
            raise FieldError(f"{field}.{kind}", f"{kind} is longer than {MAX_CONSTRAINT_BYTES} bytes")

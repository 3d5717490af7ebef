"""How many prompt tokens a step may take while it carries decoding requests.

A decode worker that serves handed-off requests also prefills prompts of its own: the
gateway moves prompts there when the prefill workers' queues are long, or when they are
short enough to skip the handoff. A step that carries a whole token budget of prompt
chunks takes several decode steps' time, and every decoding request waits for it, the
handed-off ones among them: under the serving benchmark's load on a CPU, their second
token came over a second after their first (docs/observability.md, "Latency by phase").

So once a handed-off request has reached an engine, a step with decoding rows takes at
most `max_decode_stretch` decode steps' time of prompt tokens, by the engine's step-time
model (engine/runner/step_time.py): the decode line at those rows and contexts, and the prefill rate. A
step with no decoding row, or on an engine that never received one (a prefill worker, a
colocated decode worker), has the token budget alone. And a step that carries a
handed-off request's first decode step (the one that samples its second token) takes no
prompt tokens at all, unless the step before took none for the same reason: the
request waited for the step in progress already, and a prompt's chunk would make its
client wait longer still for a token it was promised a step away.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from engine.request import Request

UNLIMITED = 1 << 62


def prefill_limit(
    stretch: float,
    running: Iterable[Request],
    num_waiting: int,
    decode_step_s: Callable[[int, int], float],
    prefill_s_per_token: float,
    floor: int,
    may_hold: bool = True,
) -> int:
    """Prompt tokens a step may take: UNLIMITED when nothing limits it (no stretch, no
    decoding row, no prompt to prefill: no running row mid-prompt and none waiting, or
    no decode step time or prefill rate known); 0 when a handed-off request's first decode
    step is in it and `may_hold` (the step before took prompt tokens); else the tokens that
    take `stretch` times the decode step of the decoding rows, at least `floor` (a prompt
    moves on however slow the prefill rate measured)."""
    if stretch <= 0 or prefill_s_per_token <= 0:
        return UNLIMITED
    num_decoding = num_prefilling = num_context_tokens = 0
    first_decode = False
    for request in running:
        if request.is_prefilling:
            num_prefilling += 1
        else:
            num_decoding += 1
            num_context_tokens += request.num_computed_tokens
            first_decode |= request.kv_ready_time is not None and request.first_decode_time is None
    if num_decoding == 0 or (num_prefilling == 0 and num_waiting == 0):
        return UNLIMITED
    seconds = decode_step_s(num_decoding, num_context_tokens)
    if seconds <= 0:  # no decode step measured yet, nor calibrated
        return UNLIMITED
    if first_decode and may_hold:
        return 0
    return max(floor, int(stretch * seconds / prefill_s_per_token))

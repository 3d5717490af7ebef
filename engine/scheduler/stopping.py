"""When a sampled token ends its request (vLLM's check_stop): an EOS or stop token once
min_tokens are out, a grammar that is complete, or the length limits."""

from __future__ import annotations

from engine.request import Request, RequestStatus


def ends_by_length(request: Request, num_tokens: int, max_model_len: int) -> bool:
    """Whether a request ends once it has `num_tokens` tokens (prompt and output)."""
    return num_tokens >= request.max_num_tokens(max_model_len)


def stop_status(request: Request, token_id: int, num_tokens: int, max_model_len: int) -> RequestStatus | None:
    """How `token_id`, just placed as the request's `num_tokens`-th token, ends it (None: it
    goes on). Its grammar's matcher takes the token, and a stop token is kept as the
    request's stop_reason."""
    params = request.sampling_params
    grammar = request.grammar
    # Sampled under the grammar's mask, so the matcher takes it (a request whose grammar
    # has ended only runs on in a step it was already scheduled for).
    if grammar is not None and not grammar.is_done:
        grammar.accept(token_id)  # False only after the matcher failed: is_done then
    num_output = num_tokens - len(request.prompt_token_ids)
    if num_output >= params.min_tokens and (token_id in request.eos_token_ids or token_id in params.stop_token_ids):
        request.stop_reason = token_id
        return RequestStatus.FINISHED_STOPPED
    if grammar is not None and grammar.is_done:
        return RequestStatus.FINISHED_STOPPED  # the output is complete: nothing may follow
    if ends_by_length(request, num_tokens, max_model_len):
        return RequestStatus.FINISHED_LENGTH
    return None

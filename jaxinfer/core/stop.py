"""What a request may do next, decided per request: whether it stops after each token it
samples (vLLM's order: EOS and stop token ids past min_tokens, then the length caps; under
structured outputs, its grammar rejecting the token or reaching its end), and how many of a
proposer's drafts it takes."""

from __future__ import annotations

from jaxinfer.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """EOS and stop token ids (past min_tokens) before the length caps, so a token that is
    both the last allowed one and EOS / a stop id finishes with "stop". Sets the request's
    finished status (and stop_reason); True when it finished."""
    num_out = len(request.output_token_ids)
    params = request.sampling_params
    if num_out >= params.min_tokens:
        last = request.output_token_ids[-1]
        if not params.ignore_eos and last == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
    if len(request.all_token_ids) >= max_model_len or num_out >= request.max_tokens:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False


def advance_grammar(request: Request, token: int) -> bool:
    """Feed a sampled token to the request's grammar; True when that ends the request
    (FINISHED_ABORTED with a stop_reason if the grammar rejected it, else FINISHED_STOPPED at
    the grammar's end). While the request is still in a reasoning model's thinking section
    (it waits for `reasoning_end_ids`), the token is not the grammar's: once the output ends
    with the end tag, the grammar applies from the next token."""
    end = request.reasoning_end_ids
    if end is not None:
        if request.output_token_ids[-len(end):] == end:
            request.reasoning_end_ids = None
        return False
    if not request.grammar.accept_tokens([token]):
        request.status = RequestStatus.FINISHED_ABORTED
        request.stop_reason = (f"structured output: the grammar rejected token {token} "
                               f"(output token {request.num_output_tokens})")
        return True
    if request.grammar.is_terminated():
        request.status = RequestStatus.FINISHED_STOPPED
        return True
    return False


def take_drafts(request: Request, tokens: list[int], max_model_len: int) -> None:
    """Set the request's drafts for the next step from the proposer's `tokens`. Only running
    requests whose tokens are all computed (decoding, not mid-prefill) take them; requests
    that sample under a grammar, with penalties or with bad words take none (the verify path
    does not filter drafts by grammar or bad words, or count drafts in penalties, yet).
    Drafts are capped so that accepting them all plus the bonus token stays within
    max_tokens and max_model_len."""
    if (request.status != RequestStatus.RUNNING or request.grammar is not None
            or request.num_computed_tokens != request.num_tokens - 1
            or request.sampling_params.uses_penalties
            or request.sampling_params.bad_words_token_ids):
        return
    room = min(request.max_tokens - request.num_output_tokens,
               max_model_len - request.num_tokens) - 1
    if room > 0:
        request.spec_token_ids = list(tokens[:room])

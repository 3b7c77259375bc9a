"""A step's sampled tokens appended to one request, and whether the request stops there."""

from __future__ import annotations

from forerun.request import Request, RequestStatus


def append_tokens(req: Request, tokens: list[int], rid: str) -> tuple[list[int], RequestStatus | None]:
    """Append `tokens` (one, or an accepted draft run) up to the first that ends the request: the tokens
    kept (a new list: the output outlives the worker's) and the finishing status, or None."""
    if len(tokens) == 1 and req.grammar is None:  # a plain decode: most requests in most steps
        tok = tokens[0]
        req.output_token_ids.append(tok)
        req.all_token_ids.append(tok)
        return [tok], check_stop(req, tok)
    status: RequestStatus | None = None
    kept = 0
    for tok in tokens:
        req.append_output_token(tok)
        kept += 1
        if req.grammar is not None and not req.grammar.accept_tokens(rid, [tok]):
            status = RequestStatus.FINISHED_ERROR
            break
        status = check_stop(req, tok)
        if status is not None:
            break
    return tokens[:kept], status


def check_stop(req: Request, token: int) -> RequestStatus | None:
    """The status `token`, just appended, ends the request with: EOS or a stop token (after min_tokens),
    a finished grammar, or max_tokens; None to go on."""
    if req.min_tokens == 0 or len(req.output_token_ids) > req.min_tokens:
        if token in req.eos_stops:
            return RequestStatus.FINISHED_STOPPED
        if token in req.stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if req.grammar is not None and req.grammar.is_terminated():
        return RequestStatus.FINISHED_STOPPED
    if len(req.output_token_ids) >= req.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None

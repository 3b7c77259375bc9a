"""The scheduler for async mode: it schedules step N+1 before step N's tokens are known."""

from __future__ import annotations

from forerun.core.scheduler import Scheduler
from forerun.request import Request


class AsyncScheduler(Scheduler):
    """Scheduler that counts tokens in flight.

    Invariants: every scheduled step that samples a kept token adds one placeholder per token it may
    yield (1 + draft slots) and applying the output removes them all (never below zero); a request is never scheduled past
    `max_tokens` or the model length, counting its placeholders, so a length stop costs no dead token;
    a preempted request is not resumed until its in-flight tokens have arrived.
    """

    def _num_new_tokens(self, req: Request) -> int:
        if req.pooling:
            return req.num_tokens - req.num_computed_tokens
        in_flight = req.num_output_placeholders  # (the properties spelled out: this runs per request per step)
        if in_flight and len(req.output_token_ids) + in_flight >= req.max_tokens:
            return 0  # the last allowed token is already in flight
        return len(req.all_token_ids) + in_flight - req.num_computed_tokens

    def _on_scheduled(self, req: Request, num_tokens: int) -> None:
        # A step samples a kept token only when it reaches the end of the known sequence: a decode, or
        # the last chunk of a prefill. A decode with k draft slots may yield up to 1 + k tokens, and
        # placeholders count the most it may yield, so max_tokens is never overshot.
        past_end = req.num_computed_tokens - len(req.all_token_ids) - req.num_output_placeholders
        if past_end >= 0 and not req.pooling:
            req.num_output_placeholders += past_end + 1

    def _on_output(self, req: Request, num_tokens: int, draft_slots: int) -> None:
        # Every step that added placeholders returns at least one token for the request, even when the
        # request was preempted meanwhile; it removes all 1 + k it added, whatever was accepted. Partial
        # prefill chunks added none and return none.
        if num_tokens:
            if draft_slots:
                super()._on_output(req, num_tokens, draft_slots)
            req.num_output_placeholders = max(0, req.num_output_placeholders - 1 - draft_slots)

    def _can_admit(self, req: Request) -> bool:
        return req.num_output_placeholders == 0

    def _structured_pending(self, req: Request) -> bool:
        # The grammar cannot produce this step's bitmask until the token in flight before it is applied.
        return req.num_output_placeholders > 1

"""Gathers a request's prompt logprobs over its prefill chunks and hands them out with its first token.

Parts are stored by prompt position, so a prefill recomputed after preemption overwrites rather than
duplicates; once handed out, the request's buffers are dropped and later parts are ignored.
"""

from __future__ import annotations

from forerun.core.scheduler_output import ModelRunnerOutput
from forerun.outputs import EngineCoreOutput
from forerun.request import Request


def store_prompt_logprobs(req: Request, result: ModelRunnerOutput, rid: str) -> None:
    part = result.prompt_logprobs.get(rid) if result.prompt_logprobs else None
    if part is None or req.prompt_logprobs is None or req.prompt_ranks is None:
        return
    stop = part.start + len(part.entries)
    req.prompt_logprobs[part.start:stop] = part.entries
    req.prompt_ranks[part.start:stop] = part.ranks


def attach_prompt_logprobs(req: Request, out: EngineCoreOutput) -> None:
    """Move the request's prompt logprobs onto its first output (a no-op for later ones)."""
    if req.prompt_logprobs is None:
        return
    out.prompt_logprobs, out.prompt_ranks = req.prompt_logprobs, req.prompt_ranks
    req.prompt_logprobs = req.prompt_ranks = None

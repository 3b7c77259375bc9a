"""The life cycle of one request inside the engine core (no tensors here)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from forerun.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
             RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR}


@dataclass
class EngineCoreRequest:
    """What a front end submits to the engine core: token ids, never text. Small and picklable."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    pooling: bool = False
    priority: int = 0  # lower runs first under the priority scheduling policy


class Request:
    """Engine-core state of one request.

    Invariants: `num_computed_tokens` counts tokens whose KV is (or is being) computed and advances at
    schedule time; `num_output_placeholders` counts sampled tokens still in flight (async mode only) and is
    never negative; `output_token_ids` holds only committed tokens, so the scheduler never hashes or
    returns a token it has not seen.
    """

    # Slots, not a __dict__: the engine thread reads and updates every running request each step, just
    # after the forward has streamed the weights through the caches, so the fewer cache lines a request
    # spans the less that step waits (with the stop test's fields below, 5-7% less engine CPU a step on
    # the tiny model's 256 requests; docs/benchmarks.md).
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "eos_token_ids", "arrival_time", "pooling",
                 "priority", "all_token_ids", "output_token_ids", "num_computed_tokens", "num_output_placeholders",
                 "num_cached_tokens", "num_preemptions", "status", "stop_reason", "block_hashes", "grammar",
                 "grammar_future", "use_spec", "final_only", "first_token_time", "prompt_logprobs", "prompt_ranks",
                 "min_tokens", "eos_stops", "stop_token_ids", "max_tokens")

    def __init__(self, core_request: EngineCoreRequest, max_model_len: int) -> None:
        self.request_id = core_request.request_id
        self.prompt_token_ids = list(core_request.prompt_token_ids)
        self.sampling_params = core_request.sampling_params
        self.eos_token_ids = core_request.eos_token_ids
        self.arrival_time = core_request.arrival_time
        self.pooling = core_request.pooling
        self.priority = core_request.priority
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_hashes: list[int] = []
        self.grammar: Any = None  # a structured-output matcher once compiled
        self.grammar_future: Any = None
        self.use_spec = True  # the scheduler may reserve draft slots for this request's decodes
        # Read once, at its end, with nothing needed on the way (no stop strings to find in the text, no
        # logprobs): the core sends its tokens in one output when it finishes instead of one a step. Why:
        # an output a step costs the engine thread a few microseconds a request (built here, then taken
        # apart by the front end), on the cores the model runs on, for a batch nobody reads.
        sp = self.sampling_params
        self.final_only = (sp.output_kind == "final_only" and not sp.stop and sp.logprobs is None
                           and not self.pooling)
        self.first_token_time: float | None = None  # set for final_only requests
        # Filled by prompt position as prefill chunks report them; handed out with the first token.
        asks = self.sampling_params.prompt_logprobs is not None and not self.pooling
        self.prompt_logprobs: list[dict[int, float] | None] | None = [None] * len(self.prompt_token_ids) if asks else None
        self.prompt_ranks: list[int | None] | None = [None] * len(self.prompt_token_ids) if asks else None
        # What the stop test reads after each token, kept here so that it does not touch the sampling
        # parameters' object a step: EOS ids (none with ignore_eos), stop token ids, min_tokens.
        self.min_tokens = sp.min_tokens
        self.eos_stops = frozenset() if sp.ignore_eos else self.eos_token_ids
        self.stop_token_ids = frozenset(sp.stop_token_ids or ())
        budget = max_model_len - len(self.prompt_token_ids)
        asked = self.sampling_params.max_tokens
        self.max_tokens = budget if asked is None else min(asked, budget)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Committed tokens: prompt plus outputs that have arrived."""
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_outputs_planned(self) -> int:
        """Outputs committed plus those in flight: what max_tokens is checked against before scheduling."""
        return len(self.output_token_ids) + self.num_output_placeholders

    @property
    def finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens}, "
                f"in_flight={self.num_output_placeholders})")

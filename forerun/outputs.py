"""What users get back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineCoreOutput:
    """New committed tokens of one request in one step (token ids only; text is the front end's job)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    # With the first new token of a request that asked: one entry per prompt token (None for the first).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank (1 = most likely)
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    pooled: list[float] | None = None
    error: str | None = None
    # A request whose tokens the core held back until it finished (Request.final_only): when its first
    # token came (time.monotonic()), for the time-to-first-token the front end would have seen.
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    """One of the `n` completions of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    delta_text: str = ""  # what this step added, for streaming
    delta_token_ids: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything about one prompt so far; `finished` once every completion is done."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    # SamplingParams.prompt_logprobs: per prompt token, None for the first, then {token_id: logprob} holding
    # the prompt token and the top k; `prompt_ranks` holds the prompt token's rank (1 = most likely).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None


@dataclass
class EmbeddingOutput:
    """The pooled vector of one input (L2-normalised when the model's pooling config says so)."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]
    error: str | None = None
    finished: bool = True

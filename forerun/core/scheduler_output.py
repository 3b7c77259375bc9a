"""What the scheduler hands to the executor each step, and what comes back. Small and picklable."""

from __future__ import annotations

from dataclasses import dataclass, field

from forerun.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Full data for a request the worker does not hold: a new one or one resumed after preemption."""

    request_id: str
    token_ids: list[int]  # prompt plus any committed outputs (a resumed request)
    num_prompt_tokens: int
    sampling_params: SamplingParams | None  # None for pooling
    block_ids: list[int]
    num_computed_tokens: int  # before this step (prefix-cache hits)
    eos_token_ids: frozenset[int] = frozenset()
    # A cached block whose KV the worker copies, before the step, into the block that holds token
    # num_computed_tokens (the prefix cache's copy of a prompt's last block: see KVCacheManager); -1: none.
    copy_block: int = -1


@dataclass(slots=True)
class CachedRequestData:
    """Only what changed for a request the worker already holds."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int  # before this step


@dataclass
class SchedulerOutput:
    """One step. `num_scheduled_tokens` is in row order: new requests first, then cached ones."""

    step_id: int
    new_reqs: list[NewRequestData]
    cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str] = field(default_factory=set)  # the worker drops these rows
    preempted_req_ids: set[str] = field(default_factory=set)  # dropped too; they come back as new
    structured_req_ids: list[str] = field(default_factory=list)  # rows that need a grammar bitmask
    pending_structured_output: bool = False  # a structured row waits for a token still in flight
    # Decode rows given draft slots: num_scheduled_tokens = 1 + slots; the worker fills at most that many
    # drafts from the request's full history (and may fill fewer, or none).
    num_draft_slots: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class GrammarOutput:
    """The bitmask for the structured rows of one step (packed int32 words, one row per request id)."""

    structured_req_ids: list[str]
    bitmask: object  # torch.Tensor [len(ids), ceil(vocab/32)] int32; typed loosely so core stays torch-free


@dataclass
class StepTiming:
    """Wall-clock spans measured on the worker, reported back for the step timeline."""

    thread: str
    spans: list[tuple[str, float, float]] = field(default_factory=list)  # (name, begin, end), time.perf_counter
    stages: list[StepTiming] = field(default_factory=list)  # earlier pipeline stages' timings, first stage first


@dataclass
class PromptLogprobsPart:
    """One step's prompt logprobs for one request: entries for prompt tokens start, start + 1, ...
    (a chunked prefill reports one part per chunk)."""

    start: int  # index of the first prompt token covered (>= 1: the first token has none)
    entries: list[dict[int, float]]  # {prompt token: logprob, top k...}, as for sampled tokens
    ranks: list[int]  # the prompt token's rank, 1 = most likely


@dataclass
class ModelRunnerOutput:
    """Sampled tokens per request (row order). A partial prefill chunk has an empty list; a decode row
    with drafts has the accepted drafts followed by the target's own token."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, list[dict[int, float]]] | None = None  # per request, per new token: {token_id: logprob}
    sampled_ranks: dict[str, list[int]] | None = None
    prompt_logprobs: dict[str, PromptLogprobsPart] | None = None  # rows asking, whose step covered prompt tokens
    pooled: dict[str, list[float]] | None = None  # pooling runner: one embedding per finished prompt
    num_drafted: dict[str, int] | None = None  # decode rows that had draft slots: drafts actually proposed
    timing: StepTiming | None = None
    error: str | None = None

    def index(self) -> dict[str, int]:
        return {rid: i for i, rid in enumerate(self.req_ids)}


EMPTY_OUTPUT = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])

"""The worker's persistent batch: one row per request it holds, kept in place across steps."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from forerun.sampling_params import SamplingParams
from forerun.worker.zero_pages import zeros_array


@dataclass(frozen=True)
class LogitControls:
    """One request's logit_bias, allowed_token_ids and bad words as the worker applies them.

    Invariants: every id is inside the vocabulary (checked when the request was submitted); `banned`
    holds the one-token bad words (banned at every step), `banned_after` the longer ones as
    (prefix, last): `last` is banned exactly when the row's output so far ends with `prefix`.
    """

    bias_ids: np.ndarray  # [N] int64
    bias_values: np.ndarray  # [N] float32
    allowed: np.ndarray | None  # [M] int64; None: every token allowed
    banned: np.ndarray  # [K] int64
    banned_after: tuple[tuple[tuple[int, ...], int], ...]

    @classmethod
    def from_params(cls, sp: SamplingParams | None) -> LogitControls | None:
        """None when the request uses none of them, so rows without controls cost nothing per step."""
        if sp is None or not sp.uses_logit_controls:
            return None
        bias = sp.logit_bias or {}
        words = sp.bad_words_token_ids or []
        return cls(bias_ids=np.fromiter(bias.keys(), np.int64, len(bias)),
                   bias_values=np.fromiter(bias.values(), np.float32, len(bias)),
                   allowed=None if sp.allowed_token_ids is None else np.unique(
                       np.asarray(sp.allowed_token_ids, np.int64)),
                   banned=np.unique(np.asarray([w[0] for w in words if len(w) == 1], np.int64)),
                   banned_after=tuple((tuple(w[:-1]), w[-1]) for w in words if len(w) > 1))


@dataclass(slots=True)
class RowState:
    """Worker-side state of one request.

    Invariant: `num_tokens` counts prompt tokens plus every token this worker sampled for the request,
    including the last one when `last_pending` (its value is then only in the device tensor of the
    previous step until `flush` writes it into `token_buf`).
    """

    req_id: str
    row: int
    num_prompt_tokens: int
    num_tokens: int
    num_computed_tokens: int
    sampling_params: SamplingParams | None
    eos_token_ids: frozenset[int]
    block_ids: list[int]
    generator: torch.Generator | None = None
    last_pending: bool = False
    output_token_ids: list[int] = field(default_factory=list)
    controls: LogitControls | None = None
    # Its token is the argmax of its raw logits: greedy, and no logprobs, penalties, min_tokens, logit
    # controls or seeded generator (which draws a number even for a greedy row). Grammars are per step.
    plain_greedy: bool = False


class InputBatch:
    """Rows of token ids, block tables and sampling parameters in preallocated numpy arrays.

    Invariants: a request keeps its row until it finishes or is preempted; a freed row is reused by
    the next new request; per-step inputs are gathered from these arrays with vectorised indexing,
    so a step costs no Python work per token.
    """

    def __init__(self, max_num_seqs: int, max_model_len: int, max_blocks_per_seq: int) -> None:
        self.max_model_len = max_model_len
        # Sized for every row at the longest context (SmolLM2: 256 x 8192 tokens, 16 MiB): on zero
        # pages only the rows' written tokens are resident.
        self.token_buf = zeros_array((max_num_seqs, max_model_len), np.int64)
        self.block_table = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int32)
        self.temperature = np.zeros(max_num_seqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_seqs, dtype=np.int64)
        self.top_p = np.ones(max_num_seqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_seqs, dtype=np.float32)
        self.rep_penalty = np.ones(max_num_seqs, dtype=np.float32)
        self.pres_penalty = np.zeros(max_num_seqs, dtype=np.float32)
        self.freq_penalty = np.zeros(max_num_seqs, dtype=np.float32)
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.states: dict[str, RowState] = {}
        self.generators: dict[str, torch.Generator] = {}
        # Requests with logit controls: while empty, building a step's sampling inputs skips them.
        self.controlled: set[str] = set()

    def add(self, req_id: str, token_ids: list[int], num_prompt_tokens: int, sp: SamplingParams | None,
            eos_token_ids: frozenset[int], block_ids: list[int], num_computed_tokens: int,
            device: torch.device) -> RowState:
        if not self.free_rows:
            raise RuntimeError("InputBatch: more requests than max_num_seqs")
        row = self.free_rows.pop()
        n = len(token_ids)
        self.token_buf[row, :n] = token_ids
        state = RowState(req_id, row, num_prompt_tokens, n, num_computed_tokens, sp, eos_token_ids, [],
                         output_token_ids=list(token_ids[num_prompt_tokens:]))
        self.num_blocks[row] = 0
        self.append_blocks(state, block_ids)
        if sp is not None:
            self.temperature[row] = sp.temperature
            self.top_k[row] = sp.top_k
            self.top_p[row] = sp.top_p
            self.min_p[row] = sp.min_p
            self.rep_penalty[row] = sp.repetition_penalty
            self.pres_penalty[row] = sp.presence_penalty
            self.freq_penalty[row] = sp.frequency_penalty
            if sp.seed is not None:
                # Kept across preemption, so a resumed request continues its random stream.
                gen = self.generators.get(req_id)
                if gen is None:
                    gen = torch.Generator(device=device)
                    gen.manual_seed(sp.seed)
                    self.generators[req_id] = gen
                state.generator = gen
            state.controls = LogitControls.from_params(sp)
            if state.controls is not None:
                self.controlled.add(req_id)
            state.plain_greedy = (sp.temperature == 0.0 and sp.logprobs is None and sp.min_tokens == 0
                                  and sp.repetition_penalty == 1.0 and sp.presence_penalty == 0.0
                                  and sp.frequency_penalty == 0.0 and state.controls is None
                                  and state.generator is None)
        self.states[req_id] = state
        return state

    def append_blocks(self, state: RowState, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[state.row])
        self.block_table[state.row, start:start + len(block_ids)] = block_ids
        self.num_blocks[state.row] = start + len(block_ids)
        state.block_ids.extend(block_ids)

    def remove(self, req_id: str, finished: bool) -> None:
        if finished:
            self.generators.pop(req_id, None)
        state = self.states.pop(req_id, None)
        self.controlled.discard(req_id)
        if state is not None:
            self.free_rows.append(state.row)

    def set_token(self, state: RowState, position: int, token_id: int) -> None:
        self.token_buf[state.row, position] = token_id

"""Prompt logprobs on the worker: the LM head over the prompt positions of the rows that ask, and only
those, then log_softmax of the raw logits (no penalties or temperature, as vLLM reports them).

Hidden state at position p predicts prompt token p + 1, so a step computing positions [start, end) of a
prompt of P tokens covers prompt tokens start + 1 .. min(end, P - 1): each chunk of a chunked prefill
contributes its own positions, and the first prompt token has no entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from forerun.core.scheduler_output import PromptLogprobsPart
from forerun.worker.input_batch import RowState

# Rows of full-vocabulary logits held at once: bounds the memory of a long prompt chunk
# (256 x 49,152 float32 is 50 MB).
_ROWS_PER_SLICE = 256


@dataclass
class _Pending:
    req_id: str
    start: int  # the first prompt token covered
    logprobs: Tensor  # [m, 1 + k]: the prompt token first, then the top k
    token_ids: Tensor  # [m, 1 + k]
    ranks: Tensor  # [m]


class PromptLogprobs:
    """One step's prompt logprobs, kept as tensors until the step's output is built (no host read in
    the forward's wake)."""

    def __init__(self, pending: list[_Pending]) -> None:
        self._pending = pending

    def to_output(self) -> dict[str, PromptLogprobsPart]:
        out = {}
        for p in self._pending:
            lp, ids = p.logprobs.tolist(), p.token_ids.tolist()
            entries = [dict(zip(i, v)) for i, v in zip(ids, lp)]
            out[p.req_id] = PromptLogprobsPart(p.start, entries, p.ranks.tolist())
        return out


def compute_prompt_logprobs(compute_logits: Callable[[Tensor], Tensor], hidden: Tensor, states: list[RowState],
                            cu: np.ndarray, token_buf: np.ndarray) -> PromptLogprobs | None:
    """For each row asking, the prompt tokens its scheduled positions predict. Called after `_prepare`,
    so a row's `num_computed_tokens` already counts this step's tokens."""
    pending = []
    for i, s in enumerate(states):
        k = None if s.sampling_params is None else s.sampling_params.prompt_logprobs
        if k is None:
            continue
        end = s.num_computed_tokens
        start = end - int(cu[i + 1] - cu[i])
        stop = min(end, s.num_prompt_tokens - 1)  # last position whose next token is a prompt token, + 1
        if stop <= start:
            continue
        first = int(cu[i])
        targets = torch.from_numpy(token_buf[s.row, start + 1:stop + 1].astype(np.int64)).to(hidden.device)
        parts = []
        for a in range(0, stop - start, _ROWS_PER_SLICE):
            b = min(a + _ROWS_PER_SLICE, stop - start)
            parts.append(_logprobs(compute_logits(hidden[first + a:first + b]), targets[a:b], k))
        lp, ids, ranks = (torch.cat(t) for t in zip(*parts))
        pending.append(_Pending(s.req_id, start + 1, lp, ids, ranks))
    return PromptLogprobs(pending) if pending else None


def _logprobs(logits: Tensor, targets: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """[m, V] logits and [m] prompt tokens -> ([m, 1 + k] logprobs, [m, 1 + k] ids, [m] ranks)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    target_lp = logprobs.gather(1, targets.unsqueeze(1))
    ranks = (logprobs > target_lp).sum(dim=-1) + 1  # ties with the prompt token do not push it down
    if k == 0:
        return target_lp, targets.unsqueeze(1), ranks
    top_lp, top_ids = logprobs.topk(k, dim=-1)
    return torch.cat([target_lp, top_lp], dim=1), torch.cat([targets.unsqueeze(1), top_ids], dim=1), ranks

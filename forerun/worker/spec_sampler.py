"""Verification of drafted tokens in one pass: greedy matching, or rejection sampling that keeps the
target distribution exactly.

The logits come in request segments: a request with d drafts has 1 + d consecutive rows, row j being
the target's distribution for the position of draft j (row d: the position after the last draft). A
request without drafts has one row and is sampled exactly as `Sampler` would sample it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from forerun.worker.sampler import Sampler, _gather_logprobs, argmax_rows, inverse_cdf, sampling_probs
from forerun.worker.sampling_metadata import SamplingMetadata


@dataclass
class VerifyOutput:
    """Per request (segment order): the tokens it keeps, accepted drafts first, then the target's own
    token; with logprobs, per kept token its [k+1] values and ids (sampled token first)."""

    tokens: list[list[int]]
    logprobs: list[list[list[float]]] | None = None
    logprob_ids: list[list[list[int]]] | None = None


class SpecSampler:
    """Accepts each draft while the target agrees, then adds one token of the target's own.

    Invariants: greedy rows accept a draft iff it equals the argmax; random rows accept a draft t with
    probability p(t) and otherwise draw from p with t removed and renormalised, so every kept token
    follows the target distribution (a one-hot draft makes this the standard rejection rule). A
    seeded request draws 1 number from its generator when it has no drafts (as `Sampler`), and
    2d + 1 numbers for d drafts, whatever is accepted: its stream depends only on its own history.
    """

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(self, logits: Tensor, meta: SamplingMetadata, counts: np.ndarray, drafts: np.ndarray,
                 generators: dict[int, torch.Generator]) -> VerifyOutput:
        """logits [R, V] in segments of `counts` rows (R = sum(counts)); `drafts` [R] int64 holds, per row,
        the draft that row verifies (-1 on a segment's last row); `generators` by segment index."""
        device = logits.device
        x, logprobs = self.sampler.process(logits, meta)
        num_rows = x.shape[0]
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        has_draft = drafts >= 0
        draft_t = torch.from_numpy(np.where(has_draft, drafts, 0)).to(device)
        has_draft_t = torch.from_numpy(has_draft).to(device)
        greedy_rows = meta.temperature.to(device) == 0
        argmax = argmax_rows(x)

        u_rec, u_acc = self._uniforms(counts, starts, generators, num_rows, device)
        temperature = torch.where(greedy_rows, torch.ones_like(meta.temperature.to(device)),
                                  meta.temperature.to(device, torch.float32))
        probs = sampling_probs(x / temperature.unsqueeze(1), meta)
        p_draft = probs.gather(1, draft_t.unsqueeze(1)).squeeze(1) / probs.sum(dim=-1)
        accept = has_draft_t & torch.where(greedy_rows, draft_t == argmax, u_acc < p_draft)
        # The draft's mass moves to the others: a rejected draft is never drawn again at its position.
        residual = torch.where(has_draft_t.unsqueeze(1),
                               probs.scatter(1, draft_t.unsqueeze(1), 0.0), probs)
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, probs, residual)
        own = torch.where(greedy_rows, argmax, inverse_cdf(residual, u_rec.unsqueeze(1)))

        # Accepted run per segment: rows up to the first rejected one (a segment's last row never accepts).
        rejected = ~accept.cpu().numpy()
        local = np.arange(num_rows) - np.repeat(starts, counts)
        first_rejected = np.minimum.reduceat(np.where(rejected, local, num_rows), starts)
        own_np = own.cpu().numpy()
        tokens = [drafts[s:s + a].tolist() + [int(own_np[s + a])]
                  for s, a in zip(starts.tolist(), first_rejected.tolist())]
        out = VerifyOutput(tokens)
        if logprobs is not None:
            chosen = torch.where(accept, draft_t, own)
            lp, ids, _ = _gather_logprobs(logprobs, chosen, meta.max_num_logprobs or 0)
            lp_rows, id_rows = lp.tolist(), ids.tolist()
            out.logprobs = [lp_rows[s:s + a + 1] for s, a in zip(starts.tolist(), first_rejected.tolist())]
            out.logprob_ids = [id_rows[s:s + a + 1] for s, a in zip(starts.tolist(), first_rejected.tolist())]
        return out

    @staticmethod
    def _uniforms(counts: np.ndarray, starts: np.ndarray, generators: dict[int, torch.Generator],
                  num_rows: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """Per row: the uniform for drawing the target's own token, and the one for the accept test."""
        u_rec = torch.rand(num_rows, device=device)
        u_acc = torch.rand(num_rows, device=device)
        for seg, gen in generators.items():
            s, c = int(starts[seg]), int(counts[seg])
            d = c - 1
            draws = torch.rand(2 * d + 1 if d else 1, generator=gen, device=device)
            u_rec[s:s + c] = draws[:c]
            if d:
                u_acc[s:s + d] = draws[c:]
        return u_rec, u_acc

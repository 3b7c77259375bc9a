"""Verification of drafted tokens in one pass: a draft is kept where the target's own token at its
position (the argmax, or a draw from the target's distribution) is that draft.

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

    Invariants: every kept token is the target's own token at its position: the argmax for greedy
    rows; for random rows an inverse-CDF draw from p with one uniform, exactly as `Sampler` draws, and
    a draft t is accepted iff that draw is t. So a draft is kept with probability p(t) and a rejected
    position's token follows p without t, as the standard rejection rule for a one-hot draft gives. A
    seeded request draws one number from its generator per kept token, in order, as it does without
    drafts: its tokens are the ones it gets without speculation wherever the logits are the same bits
    (batch-invariant mode), and its stream depends only on its own history.
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
        temperature = torch.where(greedy_rows, torch.ones_like(meta.temperature.to(device)),
                                  meta.temperature.to(device, torch.float32))
        probs = sampling_probs(x / temperature.unsqueeze(1), meta)
        drawn = inverse_cdf(probs, torch.rand(num_rows, 1, device=device))
        for seg, gen in generators.items():
            if not bool(greedy_rows[starts[seg]]):
                self._seeded_draws(probs, drawn, int(starts[seg]), int(counts[seg]), drafts, gen)
        own = torch.where(greedy_rows, argmax, drawn)
        accept = has_draft_t & (own == draft_t)

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
    def _seeded_draws(probs: Tensor, drawn: Tensor, start: int, count: int, drafts: np.ndarray,
                      gen: torch.Generator) -> None:
        """A seeded segment's own tokens into `drawn`, one number from `gen` per row, up to the first row
        whose draw rejects its draft (the last kept token): as many numbers as tokens kept."""
        for row in range(start, start + count):
            u = torch.rand(1, 1, generator=gen, device=probs.device)
            drawn[row] = inverse_cdf(probs[row:row + 1], u)[0]
            if drafts[row] < 0 or int(drawn[row]) != drafts[row]:
                return

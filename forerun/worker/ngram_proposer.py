"""N-gram (prompt lookup) drafting: propose the tokens that followed the last n tokens where they last
appeared earlier in the request's own history (prompt and outputs)."""

from __future__ import annotations

import numpy as np


class NgramProposer:
    """Finds the longest suffix n-gram (prompt_lookup_max down to prompt_lookup_min tokens) that occurred
    before, at its earliest occurrence, and proposes up to k tokens that followed it.

    Invariants: a proposal depends only on the history passed in (so every tensor-parallel rank,
    given the same history, proposes the same drafts); it is empty when no n-gram of at least
    `min_n` tokens matches; its length never exceeds the k asked.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt_lookup_min/max: need 1 <= min <= max, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, history: np.ndarray, k: int) -> np.ndarray:
        """history: 1-D int64 token ids, the last one the token just sampled. Returns up to k drafts."""
        length = history.shape[0]
        if k <= 0 or length <= self.min_n:
            return history[:0]
        # Candidate match ends: earlier positions holding the last token. Each then extends backwards
        # one column per n-gram length (at most max_n vectorised compares, never a loop per token).
        ends = np.flatnonzero(history[:-1] == history[-1])
        if ends.size == 0:
            return history[:0]
        match = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for j in range(1, self.max_n):
            back = ends - j
            ok = alive & (back >= 0)
            ok[ok] = history[back[ok]] == history[length - 1 - j]
            if not ok.any():
                break
            match += ok
            alive = ok
        best = int(match.max())
        if best < self.min_n:
            return history[:0]
        # Earliest occurrence among the longest matches: in a copy or an edit that is the source in the
        # prompt, and it has the most tokens after it (a run of one token drafts k, not 1).
        end = int(ends[np.flatnonzero(match == best)[0]])
        return history[end + 1:end + 1 + k]

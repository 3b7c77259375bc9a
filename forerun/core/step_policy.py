"""The prefill/decode policy: which kind of work one step may hold (mixed, split or prefill-first)."""

from __future__ import annotations

import enum
from typing import Literal

PrefillDecodePolicy = Literal["mixed", "split", "prefill-first"]
PREFILL_DECODE_POLICIES: tuple[str, ...] = ("mixed", "split", "prefill-first")


class Phase(enum.Enum):
    """What one scheduling pass may take: everything under one budget, only prefills, or only decodes."""

    ANY = "any"
    PREFILL = "prefill"
    DECODE = "decode"


class StepPolicy:
    """Orders the passes the scheduler tries each step; the first pass that schedules anything is the step.

    - `mixed`: a single ANY pass, so batches are exactly those of the phase-free scheduler.
    - `prefill-first` (SGLang's default): a PREFILL pass (mid-prefill requests, then new ones under the
      budget), and only when it schedules nothing, a DECODE pass. Prefills and decodes never share a step.
    - `split` (the Spyre plugin's rule for static-shape devices): a step is one request's prefill chunk or
      one decode of every running request; at most one request is mid-prefill; prefills go first, but
      after `interleave` prefill steps in a row, a decode step comes next whenever a decode is ready
      (with 1, Spyre's default, a prefill chunk runs only after a decode step, unless nothing decodes).

    Invariant: a decode step resets the count of prefill steps in a row, and a prefill step may only
    follow `interleave` of them when no request has a decode to run, so no decode waits behind more than
    `interleave` prefill steps.
    A pass that finds nothing falls through to the other kind, so no policy leaves a step empty when
    the phase-free scheduler would have scheduled something.
    """

    def __init__(self, policy: str = "mixed", interleave: int = 1) -> None:
        validate_policy(policy, interleave)
        self.policy = policy
        self.interleave = interleave
        self._prefills_in_a_row = 0

    @property
    def max_prefill_requests(self) -> int | None:
        """Most requests a PREFILL pass may hold (split: one); None: as many as the budget allows."""
        return 1 if self.policy == "split" else None

    @property
    def needs_decode_ready(self) -> bool:
        """Whether `phases` reads `decode_ready` (finding it walks the running list)."""
        return self.policy == "split" and self._prefills_in_a_row >= self.interleave

    def phases(self, decode_ready: bool) -> tuple[Phase, ...]:
        """The passes to try this step, in order. `decode_ready`: a running request had a decode to run
        before this step was scheduled."""
        if self.policy == "mixed":
            return (Phase.ANY,)
        if self.policy == "split" and decode_ready and self._prefills_in_a_row >= self.interleave:
            return (Phase.DECODE, Phase.PREFILL)
        return (Phase.PREFILL, Phase.DECODE)

    def record(self, taken: Phase | None) -> None:
        """Account for the pass that made this step (None: the step was empty)."""
        if taken is Phase.DECODE:
            self._prefills_in_a_row = 0
        elif taken is Phase.PREFILL:
            self._prefills_in_a_row += 1


def validate_policy(policy: object, interleave: object) -> None:
    """ValueError naming the field for an unknown policy or a non-positive interleave count."""
    if policy not in PREFILL_DECODE_POLICIES:
        raise ValueError(f"prefill_decode_policy: expected one of {', '.join(PREFILL_DECODE_POLICIES)}, "
                         f"got {policy!r}")
    if not isinstance(interleave, int) or isinstance(interleave, bool) or interleave < 1:
        raise ValueError(f"split_interleave_steps: must be a positive integer, got {interleave!r}")

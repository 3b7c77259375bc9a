"""Speculative decoding totals, kept by the scheduler and reported by the engine and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecDecodeStats:
    """Speculative decoding totals since the engine started (counted for requests still live)."""

    num_drafts: int = 0  # verifications: decode rows that carried at least one draft
    num_draft_tokens: int = 0  # drafts the worker proposed
    num_accepted_tokens: int = 0  # drafts the target model confirmed
    num_draft_slots: int = 0  # slots the scheduler reserved (the worker fills at most these)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step yields: accepted drafts plus the target's own token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

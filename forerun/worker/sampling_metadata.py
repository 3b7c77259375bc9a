"""Per-step, per-row sampling parameters in tensor form, as the worker hands them to the Sampler."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class SamplingMetadata:
    """Sampling parameters for one step's batch of logits rows.

    Invariant: row i of every per-row tensor describes row i of the logits the
    Sampler receives, and every per-row tensor has the batch size B as its first
    dimension. A field left as None (or an "off" value in a row) means the
    option is disabled for that row; the model runner passes None when no row
    uses an option so that the Sampler skips its work entirely.

    Token-id tensors are padded with vocab_size, an id that no real token has,
    so padding can be scattered into a spare column and dropped.
    """

    temperature: Tensor  # [B] float32; 0 means greedy for that row
    top_k: Tensor | None = None  # [B] int64; 0 or >= vocab means off
    top_p: Tensor | None = None  # [B] float32 in (0, 1]; 1 means off
    min_p: Tensor | None = None  # [B] float32 in [0, 1); 0 means off
    # Applied to tokens seen in the prompt or the output: logit > 0 divided, < 0 multiplied.
    repetition_penalty: Tensor | None = None  # [B] float32; 1 means off
    presence_penalty: Tensor | None = None  # [B] float32; 0 means off; once if the token is in the output
    frequency_penalty: Tensor | None = None  # [B] float32; 0 means off; times the count in the output
    prompt_token_ids: Tensor | None = None  # [B, Lp] int64 padded with vocab_size
    output_token_ids: Tensor | None = None  # [B, Lo] int64 padded with vocab_size
    # Row -> that request's seeded generator; rows not listed draw from the default RNG.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    max_num_logprobs: int | None = None  # None: no row asked; else the largest top-n asked
    # Fast-path hints. Both False (the default) is always correct: the Sampler then
    # computes greedy and random results and picks per row by temperature == 0.
    all_greedy: bool = False
    all_random: bool = False
    # Rows still below min_tokens: (row, stop token ids that must not be sampled yet).
    min_tokens_block: list[tuple[int, list[int]]] | None = None
    bad_token_mask: Tensor | None = None  # [B, V] bool; True tokens are never sampled
    # The requests' logit_bias, sparse: (rows [N] int64, token ids [N] int64, biases [N] float32), added
    # to the logits; a (row, id) pair appears at most once.
    logit_bias: tuple[Tensor, Tensor, Tensor] | None = None
    # [B, V] bool: tokens allowed_token_ids and bad words ban this step. Unlike bad_token_mask, a row it
    # would leave with no token at all keeps its logits without these bans (the grammar's mask wins).
    banned_tokens: Tensor | None = None

    @property
    def num_rows(self) -> int:
        """Batch size B."""
        return int(self.temperature.shape[0])

    @property
    def has_penalties(self) -> bool:
        """Whether any penalty tensor is present (the Sampler then needs token ids)."""
        return (self.repetition_penalty is not None or self.presence_penalty is not None
                or self.frequency_penalty is not None)

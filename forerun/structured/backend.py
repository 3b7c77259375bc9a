"""The interface a structured-output library must offer; xgrammar is one implementation."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from forerun.structured.spec import GrammarKey


@dataclass(frozen=True)
class CompiledGrammar:
    """A grammar compiled against one tokenizer, shared read-only by every request using it.

    Invariant: `handle` was produced by the backend that will build matchers from it, for the
    spec named by `key`.
    """

    key: GrammarKey
    handle: object  # backend-specific compiled object


class StructuredOutputGrammar(ABC):
    """One request's position in its grammar.

    Invariant: the state reflects exactly the tokens accepted and not rolled back since creation
    or the last `reset()`; a rejected `accept_tokens` call leaves the state unchanged.
    """

    @abstractmethod
    def accept_tokens(self, req_id: str, token_ids: Sequence[int]) -> bool:
        """Advance over `token_ids`; on the first rejected token undo this call and return False."""

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of a packed int32 bitmask (bit set = allowed)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once a stop token was accepted: nothing more may be generated."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (e.g. rejected speculative tokens)."""

    @abstractmethod
    def reset(self) -> None:
        """Return to the start of the grammar (e.g. after preemption with recomputation)."""

    @property
    @abstractmethod
    def num_accepted_tokens(self) -> int:
        """Tokens accepted and not rolled back: the most `rollback` can undo."""


class StructuredOutputBackend(ABC):
    """Compiles specs for one tokenizer and model vocabulary, and makes per-request matchers.

    Invariant: every bitmask and matcher it hands out covers `vocab_size` (the model's vocabulary,
    which may exceed the tokenizer's; ids the tokenizer lacks are never allowed). `compile` is
    safe to call from several threads at once and compiles each key at most once while cached.
    """

    vocab_size: int

    @abstractmethod
    def validate(self, key: GrammarKey) -> None:
        """Cheap check that the spec parses; raises ValueError naming the field otherwise."""

    @abstractmethod
    def compile(self, key: GrammarKey) -> CompiledGrammar:
        """Compile (or fetch from cache) the grammar for `key`; raises ValueError if invalid."""

    @abstractmethod
    def new_grammar(self, compiled: CompiledGrammar) -> StructuredOutputGrammar:
        """A fresh matcher at the start of `compiled`."""

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        """A packed [num_rows, ceil(vocab_size / 32)] int32 bitmask with every token allowed."""
        words = (self.vocab_size + 31) // 32
        # numpy fills it: a torch op of this size would start an OpenMP pool on the engine thread, and a
        # second pool beside the worker's oversubscribes the cores (see forerun/executor/uni.py).
        return torch.from_numpy(np.full((num_rows, words), -1, dtype=np.int32))

    def close(self) -> None:
        """Release backend resources (caches); the default holds none beyond Python objects."""

"""The engine's single entry point to structured output: validate, compile off-loop, fill bitmasks.

The worker unpacks a bitmask into its sampler's mask (`forerun.worker.sampling_inputs.grammar_bad_token_mask`).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from forerun.structured.backend import CompiledGrammar, StructuredOutputBackend, StructuredOutputGrammar
from forerun.structured.spec import GrammarKey, StructuredOutputsParams


class StructuredOutputManager:
    """Compiles request grammars on a thread pool and turns matchers into logit masks.

    Invariants: compilation never runs on the caller's thread (the step loop), except the cheap
    parse in `validate_sync`; a spec is compiled at most once while cached, whatever the number
    of requests using it; bitmasks cover the model's `vocab_size`, and ids past the tokenizer's
    vocabulary are never allowed in a structured row.

    What `validate_sync` checks, and why it is cheap enough for submission time: the spec's
    shape (exactly one field; JSON text parses; choices are non-empty strings) and the
    backend's parse of the schema/regex/grammar into a grammar, which does no per-token work
    (microseconds to about a millisecond). The expensive step, precomputing token masks
    against the vocabulary, runs in the pool; if it still fails there, the future raises
    ValueError.
    """

    def __init__(
        self,
        tokenizer_folder: Path,
        vocab_size: int,
        max_workers: int = 1,
        *,
        eos_token_ids: Sequence[int] | None = None,
        backend: StructuredOutputBackend | None = None,
    ) -> None:
        if max_workers <= 0:
            raise ValueError(f"max_workers: must be positive, got {max_workers}")
        if backend is None:
            # Imported here so that using the spec alone does not load xgrammar (and, through
            # it, transformers): about a second and a half.
            from forerun.structured.xgrammar_backend import XGrammarBackend

            backend = XGrammarBackend(Path(tokenizer_folder), vocab_size, eos_token_ids=eos_token_ids)
        if backend.vocab_size != vocab_size:
            raise ValueError(f"vocab_size: {vocab_size} differs from the backend's {backend.vocab_size}")
        self.backend = backend
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="forerun-grammar")

    def validate_sync(self, params: StructuredOutputsParams) -> GrammarKey:
        """Raise ValueError naming the bad field if `params` cannot compile; return its cache key."""
        key = params.key()
        self.backend.validate(key)
        return key

    def submit(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """Validate now (raising ValueError), compile in the pool; the future may raise ValueError."""
        key = self.validate_sync(params)
        return self._pool.submit(self.backend.compile, key)

    def new_matcher(self, compiled: CompiledGrammar) -> StructuredOutputGrammar:
        return self.backend.new_grammar(compiled)

    def grammar_bitmask(self, matchers: Sequence[StructuredOutputGrammar | None]) -> torch.Tensor | None:
        """Packed int32 bitmask [len(matchers), ceil(V/32)] for a batch in row order.

        None rows (unconstrained requests) allow everything. Terminated rows also allow
        everything: in async mode a request that just accepted its stop token still computes
        one dead token, which is discarded, and an all-masked row would sample NaNs.
        Returns None when no row is constrained, so the sampler can skip masking.
        """
        if all(m is None or m.is_terminated() for m in matchers):
            return None
        bitmask = self.backend.allocate_bitmask(len(matchers))
        for row, matcher in enumerate(matchers):
            if matcher is not None and not matcher.is_terminated():
                matcher.fill_bitmask(bitmask, row)
        return bitmask

    def close(self) -> None:
        """Stop the pool (waiting for running compiles) and drop cached grammars."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.backend.close()

    def __enter__(self) -> StructuredOutputManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

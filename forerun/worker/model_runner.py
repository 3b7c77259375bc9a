"""Runs one step on the worker: prepare inputs from the persistent batch, forward, then sample."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from forerun.config import SpeculativeConfig
from forerun.core.scheduler_output import (GrammarOutput, ModelRunnerOutput, SchedulerOutput,
                                           StepTiming)
from forerun.kernels.ops import NativeOps
from forerun.model.attention import AttentionMetadata
from forerun.worker.input_batch import InputBatch, RowState
from forerun.worker.ngram_proposer import NgramProposer
from forerun.worker.prompt_logprobs import PromptLogprobs, compute_prompt_logprobs
from forerun.worker.sampler import Sampler, SamplerOutput, argmax_rows
from forerun.worker.spec_sampler import SpecSampler
from forerun.worker.sampling_inputs import build_sampling_metadata, grammar_bad_token_mask


_NO_DRAFTS = np.zeros(0, np.int64)  # a shared empty proposal: read-only, so no step can change it
_NO_DRAFTS.setflags(write=False)


@dataclass
class _StepInFlight:
    """What `execute_model` leaves for `sample_tokens`: the kept rows and their logits."""

    req_ids: list[str]
    sampling_states: list[RowState]  # rows whose sampled token is kept, in logits order
    logits: Tensor | None
    spans: list[tuple[str, float, float]]
    drafts: list[np.ndarray] | None = None  # per kept row, the drafts its logits verify (None: no drafts)
    num_drafted: dict[str, int] | None = None  # rows given draft slots: how many drafts were proposed
    prompt_logprobs: PromptLogprobs | None = None  # rows asking for prompt logprobs whose step covered prompt tokens


class ModelRunner:
    """Owns the model, its KV cache and the persistent batch of one rank.

    Invariants: `execute_model` and `sample_tokens` alternate; the previous step's sampled ids stay in
    `_prev_sampled` (on the device) and are scattered into the next step's input ids there, so the next
    forward never waits for a host copy; a row of a partial prefill chunk computes no logits and draws
    nothing from its seeded generator. With speculation, each row's own token count and computed count
    are the truth (the scheduler's are upper bounds until it learns what was accepted): drafts are
    proposed from the whole history, the token sampled last step included, and a row computes
    1 + drafts tokens from its true position.
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[Tensor], block_size: int, max_num_seqs: int,
                 max_model_len: int, vocab_size: int, device: torch.device, native: NativeOps | None = None,
                 spec: SpeculativeConfig | None = None) -> None:
        self.model = model
        self.native = native  # the C kernels, where they run: greedy rows' argmax
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self._on_host = device.type == "cpu"
        max_blocks = -(-max_model_len // block_size)
        self.batch = InputBatch(max_num_seqs, max_model_len, max_blocks)
        self.sampler = Sampler()
        self.proposer = None if spec is None else NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        self.spec_sampler = SpecSampler(self.sampler)
        self._step: _StepInFlight | None = None
        self._prev_sampled: Tensor | None = None
        self._prev_values: list[int] = []  # `_prev_sampled` as host ints (read for the step's output anyway)
        self._prev_rows: dict[str, tuple[RowState, int]] = {}

    # ---- state updates -------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.batch.remove(rid, finished=True)
        for rid in so.preempted_req_ids:
            self.batch.remove(rid, finished=False)
        for new in so.new_reqs:
            self.batch.remove(new.request_id, finished=False)  # resumed after preemption: start over
            self.batch.add(new.request_id, new.token_ids, new.num_prompt_tokens, new.sampling_params,
                           new.eos_token_ids,
                           new.block_ids, new.num_computed_tokens, self.device)
            if new.copy_block >= 0:
                self._copy_block(new.copy_block, new.block_ids[new.num_computed_tokens // self.block_size])
        for cached in so.cached_reqs:
            state = self.batch.states[cached.request_id]
            self.batch.append_blocks(state, cached.new_block_ids)
            if self.proposer is None:  # with speculation the scheduler's count is only an upper bound
                state.num_computed_tokens = cached.num_computed_tokens

    def _copy_block(self, src: int, dst: int) -> None:
        """Every layer's K and V of block `src` into block `dst` (the caches are laid out as the model's
        kv_cache_shape says: K and V first, then blocks). Steps run in order, so `src`, computed by
        an earlier step, is complete; this step's forward writes only after the copy."""
        for cache in self.kv_caches:
            cache[:, dst].copy_(cache[:, src])

    # ---- execute -------------------------------------------------------------------------------
    def _begin_step(self, so: SchedulerOutput) -> tuple[float, list[str], list[RowState]] | None:
        """Apply the step's state changes; its start time, request ids and rows, or None for an empty
        step (then recorded as done: only its prepare span)."""
        t0 = time.perf_counter()
        self._update_states(so)
        req_ids = list(so.num_scheduled_tokens)
        if not req_ids:
            self._step = _StepInFlight([], [], None, [("prepare", t0, time.perf_counter())])
            return None
        return t0, req_ids, [self.batch.states[rid] for rid in req_ids]

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> None:
        begun = self._begin_step(so)
        if begun is None:
            return
        t0, req_ids, states = begun
        drafts = self._propose(states, so)
        input_ids, positions, attn, keep_idx, cu = self._prepare(states, so, drafts)
        t1 = time.perf_counter()
        hidden = self._run_model(input_ids, positions, attn, cu)
        self._after_forward(req_ids, states, hidden, keep_idx, cu, [("prepare", t0, t1)], drafts)

    def _run_model(self, input_ids: Tensor, positions: Tensor, attn: AttentionMetadata | None,
                   cu: np.ndarray) -> Tensor:
        return self.model(input_ids, positions, self.kv_caches, attn)

    def _after_forward(self, req_ids: list[str], states: list[RowState], hidden: Tensor, keep_idx: list[int],
                       cu: np.ndarray, spans: list[tuple[str, float, float]],
                       drafts: dict[str, np.ndarray] | None = None) -> None:
        """Generation: logits only for the rows that keep a sampled token (for a row with d drafts, its
        last 1 + d positions)."""
        logits = None
        kept = [states[i] for i in keep_idx]
        with_drafts = bool(drafts) and any(len(d) for d in drafts.values())
        row_drafts = [drafts.get(s.req_id, _NO_DRAFTS) for s in kept] if with_drafts else None
        if keep_idx:
            if row_drafts is None and len(keep_idx) == hidden.shape[0]:
                # Every position kept, one a row (a decode step): the rows as they are, which a fused
                # step's logits are already computed for (forerun.kernels.decode), without the index
                # arithmetic below (about 80 us a step at one request, run cold after the forward).
                rows = hidden
            else:
                ends = cu[1:][keep_idx]
                if row_drafts is None:
                    logits_idx = ends - 1
                else:
                    counts = np.fromiter((1 + len(d) for d in row_drafts), np.int64, len(kept))
                    first = np.repeat(ends - counts, counts)
                    logits_idx = (first + np.arange(int(counts.sum()))
                                  - np.repeat(np.cumsum(counts) - counts, counts))
                every = len(logits_idx) == hidden.shape[0]  # distinct increasing positions: then 0 .. n-1
                rows = hidden if every else hidden[torch.from_numpy(logits_idx).to(self.device)]
            # In the LM head's dtype: greedy rows read bf16 logits without a float32 copy (0.6 ms of a
            # 64-row step); the sampler makes its own float32 copy.
            logits = self.model.compute_logits(rows, float32=False)
        prompt_lps = compute_prompt_logprobs(self.model.compute_logits, hidden, states, cu, self.batch.token_buf)
        spans.append(("forward", spans[-1][2], time.perf_counter()))
        num_drafted = None if drafts is None else {rid: len(d) for rid, d in drafts.items()}
        self._step = _StepInFlight(req_ids, kept, logits, spans, row_drafts, num_drafted, prompt_lps)

    def _propose(self, states: list[RowState], so: SchedulerOutput) -> dict[str, np.ndarray] | None:
        """Drafts for the rows given draft slots, written after each row's known tokens in `token_buf`."""
        if self.proposer is None:
            return None
        # The token sampled last step must be on the host before drafting: stale history is what
        # collapses acceptance when drafting runs a step ahead.
        self._flush_prev()
        if not so.num_draft_slots:
            return None
        out: dict[str, np.ndarray] = {}
        buf = self.batch.token_buf
        for s in states:
            slots = so.num_draft_slots.get(s.req_id)
            if slots is None:
                continue
            d = _NO_DRAFTS
            if s.num_computed_tokens == s.num_tokens - 1:  # a decode: only the last token is new
                slots = min(slots, buf.shape[1] - s.num_tokens)
                d = self.proposer.propose(buf[s.row, :s.num_tokens], slots).copy()
                buf[s.row, s.num_tokens:s.num_tokens + len(d)] = d
            out[s.req_id] = d
        return out

    def _prepare(self, states: list[RowState], so: SchedulerOutput, drafts: dict[str, np.ndarray] | None = None):
        b = self.batch
        # The rows' counts in one pass and one array, each field then a contiguous row of it: every numpy
        # call costs microseconds here, just after the forward has streamed the weights through the caches.
        counts = so.num_scheduled_tokens
        n, start, known, rows = np.array([(counts[s.req_id], s.num_computed_tokens, s.num_tokens, s.row)
                                          for s in states], np.int64).reshape(len(states), 4).T.copy()
        if drafts:  # a row with draft slots computes its last token plus the drafts actually proposed
            n = np.fromiter((1 + len(drafts[s.req_id]) if s.req_id in drafts else n[i]
                             for i, s in enumerate(states)), np.int64, len(states))
        cu = np.zeros(len(states) + 1, np.int64)
        np.cumsum(n, out=cu[1:])
        total = int(cu[-1])
        decode = total == len(states)  # one token a row, at the row's own next position
        if decode:
            tok_rows, positions = rows, start
        else:
            tok_rows = np.repeat(rows, n)
            positions = np.repeat(start - cu[:-1], n) + np.arange(total)
        input_ids = torch.from_numpy(b.token_buf[tok_rows, positions])
        seq_lens = start + n
        keep_idx = np.nonzero(seq_lens >= known)[0]  # rows that sample a token the worker keeps
        for s, length in zip(states, seq_lens.tolist()):
            s.num_computed_tokens = length
        input_ids = self._to_device(input_ids)
        self._scatter_pending(states, start, known, cu, input_ids)
        attn = None
        if self.kv_caches:  # encoder-only models keep no cache and need no block tables
            max_blocks = int(-(-seq_lens.max() // self.block_size))
            tables = b.block_table[rows, :max_blocks]
            slots = b.block_table[tok_rows, positions // self.block_size].astype(np.int64) * self.block_size \
                + positions % self.block_size
            if decode:
                attn = AttentionMetadata.for_decode(seq_lens, tables, slots, self.block_size, self.device)
            else:
                attn = AttentionMetadata.build(n.tolist(), seq_lens.tolist(), torch.from_numpy(tables).to(self.device),
                                               torch.from_numpy(slots).to(self.device), self.block_size)
        return input_ids, self._to_device(torch.from_numpy(positions)), attn, keep_idx.tolist(), cu

    def _to_device(self, t: Tensor) -> Tensor:
        """`t` (a host tensor) on the model's device. On CPU `t` itself, without the torch call, which
        costs up to ~20 us right after a forward (see _prepare)."""
        return t if self._on_host else t.to(self.device)

    def _scatter_pending(self, states: list[RowState], start: np.ndarray, known: np.ndarray,
                         cu: np.ndarray, input_ids: Tensor) -> None:
        """Fill inputs whose token was sampled last step and is known only on the device."""
        rows, src = [], []
        prev_rows = self._prev_rows
        for i, s in enumerate(states):
            if s.last_pending:
                prev = prev_rows.get(s.req_id)
                if prev is not None and prev[0] is s:
                    rows.append(i)
                    src.append(prev[1])
        if not rows:
            return
        dst = (cu[:-1] + known - 1 - start)[rows]  # each such row's last known token, in the flat step
        assert self._prev_sampled is not None
        if self._on_host:
            # On the host, numpy's indexing. Why: arithmetic on numpy scalars per row and three torch
            # calls made input preparation about a quarter slower (a tiny model's step of ~200 rows,
            # sync mode: 580-650 against 760-810 us), and each torch call gives the GIL up.
            input_ids.numpy()[dst] = self._prev_sampled.numpy()[src]
        else:
            input_ids[torch.from_numpy(dst).to(self.device)] = self._prev_sampled[torch.tensor(src, device=self.device)]

    def _flush_prev(self) -> None:
        """Write the previous step's sampled ids into host state (token buffer, output ids)."""
        if self._prev_sampled is None:
            return
        values = self._prev_values
        for rid, (state, i) in self._prev_rows.items():
            if self.batch.states.get(rid) is state and state.last_pending:
                tok = values[i]
                self.batch.set_token(state, state.num_tokens - 1, tok)
                state.output_token_ids.append(tok)
                state.last_pending = False
        self._prev_sampled = None
        self._prev_rows = {}

    # ---- sample --------------------------------------------------------------------------------
    @torch.inference_mode()
    def sample_tokens(self, grammar: GrammarOutput | None = None) -> ModelRunnerOutput:
        step = self._step
        assert step is not None, "sample_tokens called without execute_model"
        self._step = None
        result = self._sample_step(step, grammar)
        if step.prompt_logprobs is not None:
            result.prompt_logprobs = step.prompt_logprobs.to_output()
        return result

    def _sample_step(self, step: _StepInFlight, grammar: GrammarOutput | None) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        self._flush_prev()
        timing = StepTiming(threading.current_thread().name, list(step.spans))
        if step.logits is None:
            timing.spans.append(("sample", t0, time.perf_counter()))
            return ModelRunnerOutput(step.req_ids, [[] for _ in step.req_ids], timing=timing)
        if step.drafts is not None:
            result = self._verify(step, grammar)
            timing.spans.append(("sample", t0, time.perf_counter()))
            result.timing = timing
            return result
        kept = step.sampling_states
        structured = grammar is not None and bool(grammar.structured_req_ids)
        if not structured and all(s.plain_greedy for s in kept):
            # What the sampler gives such rows, without building its per-row inputs: they cost about a
            # third of a step's sampling at one request and a tenth to a fifth at ~200 rows.
            ids = self.model.greedy_ids(step.logits)  # the fused decode step's, where it gave them
            if ids is None and self.native is not None:
                ids = self.native.argmax_rows(step.logits)
            out = SamplerOutput(argmax_rows(step.logits.float()) if ids is None else ids)
        else:
            meta = build_sampling_metadata(self.batch, kept, self.vocab_size, self.device)
            if structured:
                assert grammar is not None
                meta.bad_token_mask = grammar_bad_token_mask(grammar, [s.req_id for s in kept],
                                                             step.logits.shape[1], self.device)
            out = self.sampler(step.logits, meta)
        for i, s in enumerate(kept):
            s.num_tokens += 1
            s.last_pending = True
        self._prev_sampled = out.sampled_token_ids
        self._prev_values = out.sampled_token_ids.tolist()
        self._prev_rows = {s.req_id: (s, i) for i, s in enumerate(kept)}
        result = self._to_output(step.req_ids, kept, out, self._prev_values)
        result.num_drafted = step.num_drafted
        timing.spans.append(("sample", t0, time.perf_counter()))
        result.timing = timing
        return result

    def _verify(self, step: _StepInFlight, grammar: GrammarOutput | None) -> ModelRunnerOutput:
        """Accept drafts against the target's logits and commit the kept tokens on the host at once
        (the next step drafts from them)."""
        kept, drafts = step.sampling_states, step.drafts
        assert drafts is not None and step.logits is not None
        counts = np.fromiter((1 + len(d) for d in drafts), np.int64, len(kept))
        expanded = [s for s, c in zip(kept, counts) for _ in range(c)]
        # Row j of a request sees drafts[:j] as output: exact for penalties and min_tokens whenever the
        # row's result is used, since a row is used only when all drafts before it were accepted.
        before = [d[:j].tolist() for d in drafts for j in range(1 + len(d))]
        meta = build_sampling_metadata(self.batch, expanded, self.vocab_size, self.device, before)
        meta.generators = {}
        if grammar is not None and grammar.structured_req_ids:
            meta.bad_token_mask = grammar_bad_token_mask(grammar, [s.req_id for s in expanded],
                                                         step.logits.shape[1], self.device)
        row_drafts = np.concatenate([np.append(d, -1) for d in drafts])
        generators = {i: s.generator for i, s in enumerate(kept) if s.generator is not None}
        v = self.spec_sampler(step.logits, meta, counts, row_drafts, generators)
        for s, toks in zip(kept, v.tokens):
            old = s.num_tokens
            self.batch.token_buf[s.row, old:old + len(toks)] = toks
            s.output_token_ids.extend(toks)
            s.num_tokens = old + len(toks)
            s.num_computed_tokens = s.num_tokens - 1  # the accepted drafts' KV is right; the rest is rewritten
            s.last_pending = False
        self._prev_sampled, self._prev_rows = None, {}
        by_req = {s.req_id: i for i, s in enumerate(kept)}
        tokens = [v.tokens[by_req[r]] if r in by_req else [] for r in step.req_ids]
        logprobs = None
        if v.logprobs is not None:
            assert v.logprob_ids is not None
            logprobs = {}
            for i, s in enumerate(kept):
                k = s.sampling_params.logprobs
                if k is not None:
                    logprobs[s.req_id] = [dict(zip(ids[:k + 1], lp[:k + 1]))
                                          for lp, ids in zip(v.logprobs[i], v.logprob_ids[i])]
        return ModelRunnerOutput(step.req_ids, tokens, logprobs=logprobs, num_drafted=step.num_drafted)

    def _to_output(self, req_ids: list[str], kept: list[RowState], out, sampled: list[int]) -> ModelRunnerOutput:
        """`sampled`: out.sampled_token_ids as a list."""
        by_req = {s.req_id: i for i, s in enumerate(kept)}
        tokens = [[sampled[by_req[r]]] if r in by_req else [] for r in req_ids]
        logprobs = None
        if out.logprobs is not None:
            lp, ids = out.logprobs.tolist(), out.logprob_token_ids.tolist()
            logprobs = {}
            for i, s in enumerate(kept):
                k = s.sampling_params.logprobs
                if k is not None:
                    logprobs[s.req_id] = [dict(zip(ids[i][:k + 1], lp[i][:k + 1]))]
        return ModelRunnerOutput(req_ids, tokens, logprobs=logprobs)

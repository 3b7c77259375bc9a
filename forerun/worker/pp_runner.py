"""The model runner of one pipeline stage: receive activations, run this stage's layers, pass them on;
the last stage samples and hands the sampled ids straight back to the first."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from forerun.core.scheduler_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput, StepTiming
from forerun.worker.input_batch import RowState
from forerun.worker.model_runner import ModelRunner, _StepInFlight
from forerun.worker.stage_link import StageLink

# Spans a stage before the last reports to the next one, in this order (one row each when tracing).
_SPANS = ("prepare", "recv", "forward")
# Token batches the first stage may leave unread before it waits for the oldest (see _take_tokens).
MAX_UNREAD_TOKEN_BATCHES = 8


@dataclass
class _IncomingTokens:
    """One step's sampled ids on their way from the last stage to the first."""

    states: list[RowState]  # the kept rows, in the order the last stage sampled them
    positions: list[int]  # where each id goes in its row's token buffer
    ids: Tensor
    work: Any  # the pending receive; `ids` is valid once it has been waited for


class PipelineModelRunner(ModelRunner):
    """ModelRunner for one pipeline stage.

    Invariants: every stage receives every step call in the same order, so all stages agree on each step's
    rows and on which rows keep a sampled token, and advance `num_tokens` for them alike; only the last
    stage computes logits and samples; its ids reach the first stage through `link`, never through the
    engine, and the first stage waits for them only when a row it is about to embed reads one, so it can
    run step N+1 while the last stage still runs step N.
    """

    def __init__(self, *args: Any, link: StageLink, rank: int, hidden_size: int, act_dtype: torch.dtype,
                 share_timing: bool) -> None:
        super().__init__(*args)
        self.link = link
        self.rank = rank
        self.hidden_size = hidden_size
        self.act_dtype = act_dtype
        self.share_timing = share_timing  # step trace on: earlier stages' spans travel with the activations
        self._incoming: deque[_IncomingTokens] = deque()
        self._earlier: list[StepTiming] = []

    # ---- execute -------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> None:
        begun = self._begin_step(so)
        if begun is None:
            return
        t0, req_ids, states = begun
        if self.link.is_first:
            self._take_tokens(states)
        input_ids, positions, attn, keep_idx, cu = self._prepare(states, so)
        spans = [("prepare", t0, time.perf_counter())]
        intermediate, earlier = None, None
        if not self.link.is_first:
            intermediate = self.link.recv_activations(int(cu[-1]), self.hidden_size, self.act_dtype)
            if self.share_timing:
                earlier = self.link.recv_timing(len(_SPANS) * self.link.stage, 4)
            spans.append(("recv", spans[-1][2], time.perf_counter()))
        out = self.model(input_ids, positions, self.kv_caches, attn, intermediate)
        if self.link.is_last:
            self._earlier = _timings_from_rows(earlier)
            self._after_forward(req_ids, states, out, keep_idx, cu, spans)
            return
        self.link.send_activations(*out)
        spans.append(("forward", spans[-1][2], time.perf_counter()))
        if self.share_timing:
            self.link.send_timing(self._timing_rows(spans, earlier))
        self._step = _StepInFlight(req_ids, [states[i] for i in keep_idx], None, spans)

    def _take_tokens(self, states: list[RowState]) -> None:
        """Write ids sampled by the last stage into the token buffer: wait for every batch up to the newest
        one that a row of this step reads. gloo cannot tell whether a receive has finished without waiting
        for it, so batches no row needs yet stay queued, up to a bound past which the oldest is read anyway
        (the engine keeps fewer steps in flight, so it has been sampled; the last stage needs nothing more
        from this one to send it)."""
        def needed() -> bool:
            return any(s.last_pending for s in states)

        while self._incoming and (needed() or len(self._incoming) > MAX_UNREAD_TOKEN_BATCHES):
            head = self._incoming.popleft()
            head.work.wait()
            for s, pos, tok in zip(head.states, head.positions, head.ids.tolist()):
                if self.batch.states.get(s.req_id) is s and s.last_pending:
                    self.batch.set_token(s, pos, tok)
                    s.output_token_ids.append(tok)
                    s.last_pending = False
        if needed():
            raise RuntimeError("pipeline: a row reads a sampled token the last stage never sent")

    def _timing_rows(self, spans: list[tuple[str, float, float]], earlier: Tensor | None) -> Tensor:
        """This stage's spans as (rank, span index, begin, end) rows after the earlier stages' rows."""
        by_name = {name: (b, e) for name, b, e in spans}
        mine = torch.tensor([[self.rank, i, *by_name.get(name, (0.0, 0.0))] for i, name in enumerate(_SPANS)],
                            dtype=torch.float64, device=self.link.device)
        return mine if earlier is None else torch.cat((earlier, mine))

    # ---- sample --------------------------------------------------------------------------------
    @torch.inference_mode()
    def sample_tokens(self, grammar: GrammarOutput | None = None) -> ModelRunnerOutput:
        if self.link.is_last:
            samples = self._step is not None and self._step.logits is not None
            result = super().sample_tokens(grammar)
            if samples:
                self.link.send_tokens(self._prev_sampled)
            if result.timing is not None:
                result.timing.stages = self._earlier
            self._earlier = []
            return result
        step = self._step
        assert step is not None, "sample_tokens called without execute_model"
        self._step = None
        t0 = time.perf_counter()
        kept = step.sampling_states
        for s in kept:  # the same bookkeeping as the sampling stage, without the values
            s.num_tokens += 1
        if self.link.is_first and kept:
            for s in kept:
                s.last_pending = True
            ids, work = self.link.irecv_tokens(len(kept))
            self._incoming.append(_IncomingTokens(kept, [s.num_tokens - 1 for s in kept], ids, work))
        timing = StepTiming(threading.current_thread().name, [*step.spans, ("sample", t0, time.perf_counter())])
        return ModelRunnerOutput(step.req_ids, [[] for _ in step.req_ids], timing=timing)


def _timings_from_rows(rows: Tensor | None) -> list[StepTiming]:
    """Earlier stages' spans, one StepTiming per rank, first stage first; zero-length spans left out."""
    if rows is None:
        return []
    out: dict[int, StepTiming] = {}
    for rank, idx, begin, end in rows.tolist():
        timing = out.setdefault(int(rank), StepTiming(f"forerun-rank{int(rank)}"))
        if end > begin:
            timing.spans.append((_SPANS[int(idx)], begin, end))
    return list(out.values())

"""Model runners for pooling (embedding) models: no sampling; each prompt yields one vector."""

from __future__ import annotations

import threading
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from forerun.core.scheduler_output import GrammarOutput, ModelRunnerOutput, StepTiming
from forerun.model.attention import AttentionMetadata
from forerun.model.pooling import PoolingConfig
from forerun.worker.input_batch import RowState
from forerun.worker.model_runner import ModelRunner


class PoolingModelRunner(ModelRunner):
    """Runs decoder models as poolers over the same paged KV cache as generation.

    Invariant: a prompt split over several chunks is pooled exactly as if run whole: mean pooling adds
    each chunk's rows into a per-request float32 sum, CLS pooling keeps the first chunk's first row, and
    last-token pooling reads the final chunk.
    """

    def __init__(self, *args, pooling: PoolingConfig, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pooling = pooling
        self._partial: dict[str, Tensor] = {}  # request -> running sum (mean) or first row (cls)
        self._pooled: dict[str, list[float]] = {}
        self._spans: list[tuple[str, float, float]] = []
        self._req_ids: list[str] = []

    def _after_forward(self, req_ids: list[str], states: list[RowState], hidden: Tensor, keep_idx: list[int],
                       cu: np.ndarray, spans: list[tuple[str, float, float]]) -> None:
        done = set(keep_idx)
        vectors: list[Tensor] = []
        finished: list[str] = []
        for i, s in enumerate(states):
            rows = hidden[int(cu[i]):int(cu[i + 1])].float()
            if self.pooling.method == "mean":
                acc = self._partial.get(s.req_id)
                total = rows.sum(0) if acc is None else acc + rows.sum(0)
                self._partial[s.req_id] = total
                vec = total / s.num_prompt_tokens
            elif self.pooling.method == "cls":
                vec = self._partial.setdefault(s.req_id, rows[0])
            else:
                vec = rows[-1]
            if i in done:
                vectors.append(vec)
                finished.append(s.req_id)
                self._partial.pop(s.req_id, None)
        self._pooled = {}
        if vectors:
            out = torch.stack(vectors)
            if self.pooling.normalize:
                out = F.normalize(out, p=2.0, dim=-1)
            self._pooled = dict(zip(finished, out.cpu().tolist()))
        spans.append(("forward", spans[-1][2], time.perf_counter()))
        self._spans, self._req_ids = spans, req_ids

    def sample_tokens(self, grammar: GrammarOutput | None = None) -> ModelRunnerOutput:
        """Nothing to sample: hand back the vectors pooled by the last `execute_model`."""
        t0 = time.perf_counter()
        timing = StepTiming(threading.current_thread().name, list(self._spans))
        timing.spans.append(("sample", t0, time.perf_counter()))
        out = ModelRunnerOutput(self._req_ids, [[] for _ in self._req_ids], pooled=self._pooled, timing=timing)
        self._pooled, self._req_ids, self._spans = {}, [], []
        return out

    def execute_model(self, so) -> None:
        self._pooled, self._req_ids = {}, []
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self._partial.pop(rid, None)
        super().execute_model(so)
        if not so.num_scheduled_tokens:
            self._spans = [("prepare", time.perf_counter(), time.perf_counter())]


class EncoderPoolingRunner(PoolingModelRunner):
    """Encoder-only models (BERT): bidirectional attention over whole prompts, no KV cache at all.

    Invariant: the scheduler gives every request its whole prompt in one step, so each row is complete.
    """

    def _run_model(self, input_ids: Tensor, positions: Tensor, attn: AttentionMetadata | None,
                   cu: np.ndarray) -> Tensor:
        return self.model(input_ids, positions, cu.tolist())

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
                       cu: np.ndarray, spans: list[tuple[str, float, float]],
                       drafts: dict[str, np.ndarray] | None = None) -> None:
        # `drafts` is always None here: pooling models never speculate (the config refuses it).
        # One reduction or gather for the whole batch: a per-request loop of small tensor ops costs more
        # than the pooling itself (each op pays the thread pool's wake-up).
        n = len(states)
        starts = torch.from_numpy(np.asarray(cu[:n], dtype=np.int64))
        ends = torch.from_numpy(np.asarray(cu[1:n + 1], dtype=np.int64))
        if self.pooling.method == "mean":
            seg = torch.repeat_interleave(torch.arange(n, device=hidden.device), (ends - starts).to(hidden.device))
            rows = hidden.new_zeros((n, hidden.shape[1]), dtype=torch.float32)
            rows.index_add_(0, seg, hidden[:int(cu[n])].float())
        else:
            rows = hidden.index_select(0, (starts if self.pooling.method == "cls" else ends - 1).to(hidden.device))
            rows = rows.float()
        done = set(keep_idx)
        for i, s in enumerate(states):  # only prompts that span several chunks carry state between steps
            acc = self._partial.pop(s.req_id, None)
            if acc is not None:
                rows[i] = rows[i] + acc if self.pooling.method == "mean" else acc
            if i not in done and self.pooling.method != "last":
                self._partial[s.req_id] = rows[i].clone()
        self._pooled = {}
        if keep_idx:
            out = rows[keep_idx]
            if self.pooling.method == "mean":
                lens = torch.tensor([states[i].num_prompt_tokens for i in keep_idx], dtype=torch.float32)
                out = out / lens.to(out.device)[:, None]
            if self.pooling.normalize:
                out = F.normalize(out, p=2.0, dim=-1)
            self._pooled = dict(zip([states[i].req_id for i in keep_idx], out.cpu().tolist()))
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

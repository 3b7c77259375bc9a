"""Turns the persistent batch's per-row sampling arrays into the Sampler's per-step tensors."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from forerun.core.scheduler_output import GrammarOutput
from forerun.worker.input_batch import InputBatch, RowState
from forerun.worker.sampling_metadata import SamplingMetadata


def build_sampling_metadata(batch: InputBatch, states: list[RowState], vocab_size: int,
                            device: torch.device, extra_outputs: list[list[int]] | None = None) -> SamplingMetadata:
    """Options that no row uses stay None, so the Sampler skips their work entirely.

    `extra_outputs[i]` are tokens that row i sees as output after the state's own (the drafts before
    the row's position when verifying drafts: penalties and min_tokens then count them)."""
    extra = extra_outputs or [[] for _ in states]
    rows = np.fromiter((s.row for s in states), np.int64, len(states))

    def col(arr: np.ndarray, off: float) -> Tensor | None:
        vals = arr[rows]
        return None if np.all(vals == off) else torch.from_numpy(vals).to(device)

    temperature = batch.temperature[rows]
    meta = SamplingMetadata(
        temperature=torch.from_numpy(temperature).to(device),
        top_k=col(batch.top_k, 0), top_p=col(batch.top_p, 1.0), min_p=col(batch.min_p, 0.0),
        repetition_penalty=col(batch.rep_penalty, 1.0), presence_penalty=col(batch.pres_penalty, 0.0),
        frequency_penalty=col(batch.freq_penalty, 0.0),
        generators={i: s.generator for i, s in enumerate(states) if s.generator is not None},
        all_greedy=bool(np.all(temperature == 0.0)), all_random=bool(np.all(temperature > 0.0)))
    asked = [s.sampling_params.logprobs for s in states if s.sampling_params.logprobs is not None]
    meta.max_num_logprobs = max(asked) if asked else None
    if meta.has_penalties:
        meta.prompt_token_ids = _padded([batch.token_buf[s.row, :s.num_prompt_tokens] for s in states],
                                        vocab_size, device)
        meta.output_token_ids = _padded([np.asarray(s.output_token_ids + e, np.int64)
                                         for s, e in zip(states, extra)], vocab_size, device)
    blocked = []
    for i, s in enumerate(states):
        sp = s.sampling_params
        if sp.min_tokens and len(s.output_token_ids) + len(extra[i]) < sp.min_tokens:
            stop_ids = set(sp.stop_token_ids or ()) | (set() if sp.ignore_eos else set(s.eos_token_ids))
            blocked.append((i, sorted(stop_ids)))
    meta.min_tokens_block = blocked or None
    return meta


def _padded(seqs: list[np.ndarray], pad: int, device: torch.device) -> Tensor:
    width = max(1, max(len(x) for x in seqs))
    out = np.full((len(seqs), width), pad, np.int64)
    for i, x in enumerate(seqs):
        out[i, :len(x)] = x
    return torch.from_numpy(out).to(device)


def grammar_bad_token_mask(grammar: GrammarOutput, req_ids: list[str], vocab_size: int,
                           device: torch.device) -> Tensor | None:
    """Unpack the packed int32 grammar bitmask (bit set = allowed) into a [rows, vocab] 'never sample' mask."""
    where = {rid: i for i, rid in enumerate(grammar.structured_req_ids)}
    rows = [(i, where[rid]) for i, rid in enumerate(req_ids) if rid in where]
    if not rows:
        return None
    bitmask = torch.as_tensor(grammar.bitmask).to(device)
    dst = torch.tensor([r[0] for r in rows], device=device)
    src = torch.tensor([r[1] for r in rows], device=device)
    # Little-endian int32 words viewed as bytes keep token order (byte k holds tokens 8k..8k+7), so one
    # lookup in a 256 x 8 table unpacks every bit at once.
    table = (torch.arange(256, device=device).unsqueeze(1) >> torch.arange(8, device=device)) & 1
    packed = bitmask[src].contiguous().view(torch.uint8).long()
    allowed = table.bool()[packed].reshape(len(rows), -1)[:, :vocab_size]
    if allowed.shape[1] < vocab_size:  # ids beyond the grammar's vocabulary are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    mask = torch.zeros(len(req_ids), vocab_size, dtype=torch.bool, device=device)
    mask[dst] = ~allowed
    return mask

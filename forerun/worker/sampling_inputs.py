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
    if batch.controlled:  # an O(1) test: a batch without logit controls pays nothing for them
        _add_logit_controls(meta, states, extra, vocab_size, device)
    return meta


def _add_logit_controls(meta: SamplingMetadata, states: list[RowState], extra: list[list[int]],
                        vocab_size: int, device: torch.device) -> None:
    """logit_bias as sparse (row, id, bias) triples; allowed_token_ids and bad words as one [B, V] ban mask.

    A bad word of several tokens bans its last token only for rows whose output (drafts before the
    row's position included) ends with the word's other tokens, so the mask is rebuilt every step."""
    bias_rows, bias_ids, bias_values = [], [], []
    allowed_rows, allowed_ids = [], []
    ban_rows, ban_ids = [], []
    for i, s in enumerate(states):
        c = s.controls
        if c is None:
            continue
        if len(c.bias_ids):
            bias_rows.append(np.full(len(c.bias_ids), i, np.int64))
            bias_ids.append(c.bias_ids)
            bias_values.append(c.bias_values)
        if c.allowed is not None:
            allowed_rows.append(i)
            allowed_ids.append(c.allowed)
        banned = [c.banned] if len(c.banned) else []
        if c.banned_after:
            out = s.output_token_ids + extra[i] if extra[i] else s.output_token_ids
            banned.append(np.asarray([last for prefix, last in c.banned_after
                                      if len(out) >= len(prefix) and tuple(out[len(out) - len(prefix):]) == prefix],
                                     np.int64))
        if banned:
            ids = np.concatenate(banned)
            ban_rows.append(np.full(len(ids), i, np.int64))
            ban_ids.append(ids)
    if bias_rows:
        meta.logit_bias = tuple(torch.from_numpy(np.concatenate(a)).to(device)  # type: ignore[assignment]
                                for a in (bias_rows, bias_ids, bias_values))
    if not allowed_rows and not any(len(a) for a in ban_ids):
        return
    mask = torch.zeros(len(states), vocab_size, dtype=torch.bool, device=device)
    if allowed_rows:
        mask[torch.tensor(allowed_rows, device=device)] = True
        rows = np.repeat(np.asarray(allowed_rows, np.int64), [len(a) for a in allowed_ids])
        mask[torch.from_numpy(rows).to(device), torch.from_numpy(np.concatenate(allowed_ids)).to(device)] = False
    if ban_rows:
        mask[torch.from_numpy(np.concatenate(ban_rows)).to(device),
             torch.from_numpy(np.concatenate(ban_ids)).to(device)] = True
    meta.banned_tokens = mask


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

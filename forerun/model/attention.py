"""Paged attention: per-step metadata, the backend interface, a plain-PyTorch SDPA backend, and one
whose decode rows run in C (forerun.kernels.attention).

KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (index 0 = K, 1 = V).
Token at position p of a sequence lives in slot block_table[p // block_size] * block_size + p % block_size.
The cache must hold only finite values (allocate it with torch.zeros): masked-out slots are still
read and weighted by 0, and 0 * NaN would poison the row.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from forerun.kernels.attention import DecodeAttention


@dataclass(frozen=True)
class PrefillChunk:
    """One row with more than one query token: tokens [start, end) of the flattened batch.

    Invariant: the queries are positions [cached, cached + end - start) of the sequence, and
    `slots` (the cache slots of positions [0, seq_len)) is None exactly when cached == 0, in
    which case attention reads the freshly computed K/V instead of the cache.
    """

    start: int
    end: int
    cached: int
    seq_len: int
    slots: Tensor | None


@dataclass
class AttentionMetadata:
    """One flattened batch: sequences in row order, each sequence's new (query) tokens contiguous.

    Invariants: sum(query_lens) == len(slot_mapping); 1 <= query_lens[i] <= seq_lens[i]; rows with
    one query token ("decode rows") are attended together in one batched call over their gathered,
    padded K/V (`decode_blocks`, `decode_len`); other rows are listed in `prefills`. Everything that
    depends only on the batch is built once per step in `build`; what also depends on the layer
    (compute dtype, sliding window, cache size) is built by the first layer and memoised here.
    """

    query_lens: list[int]
    seq_lens: list[int]
    block_tables: Tensor
    slot_mapping: Tensor
    block_size: int
    num_tokens: int
    all_decode: bool
    decode_token_idx: Tensor | None  # token indices of decode rows; None when all rows are decode
    decode_blocks: Tensor | None  # [num_decode * blocks_per_row] block ids, row-major
    decode_seq_lens: Tensor | None  # [num_decode]
    decode_len: int  # padded context length of the decode gather (multiple of block_size)
    prefills: list[PrefillChunk]
    _memo: dict[tuple, Any] = field(default_factory=dict, repr=False)  # per-step lazily built tensors

    @property
    def num_decode(self) -> int:
        return 0 if self.decode_seq_lens is None else int(self.decode_seq_lens.shape[0])

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: Tensor,
              slot_mapping: Tensor, block_size: int) -> "AttentionMetadata":
        """Validate one step's batch and precompute the gather indices every layer uses."""
        _validate(query_lens, seq_lens, block_tables, slot_mapping, block_size)
        device = block_tables.device
        tables = block_tables.clamp(min=0).long()  # padding may be -1; it is masked, never read
        decode_rows = [i for i, q in enumerate(query_lens) if q == 1]
        decode_blocks = decode_seq_lens = decode_token_idx = None
        decode_len = 0
        if decode_rows:
            lens = [seq_lens[i] for i in decode_rows]
            per_row = -(-max(lens) // block_size)
            decode_len = per_row * block_size
            rows = tables if len(decode_rows) == len(query_lens) else tables[decode_rows]
            # contiguous(): with one block per row, reshape would return a strided view, and the C
            # kernel reads this buffer as row-major `per_row` ids per row.
            decode_blocks = rows[:, :per_row].contiguous().view(-1)
            decode_seq_lens = torch.tensor(lens, dtype=torch.int64, device=device)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        all_decode = len(decode_rows) == len(query_lens)
        if decode_rows and not all_decode:
            decode_token_idx = torch.tensor([starts[i] for i in decode_rows], dtype=torch.int64, device=device)
        prefills = []
        for i, q in enumerate(query_lens):
            if q == 1:
                continue
            cached = seq_lens[i] - q
            slots = None
            if cached:
                pos = torch.arange(seq_lens[i], device=device)
                slots = tables[i, pos // block_size] * block_size + pos % block_size
            prefills.append(PrefillChunk(starts[i], starts[i + 1], cached, seq_lens[i], slots))
        return cls(list(query_lens), list(seq_lens), block_tables, slot_mapping.long(), block_size,
                   starts[-1], all_decode, decode_token_idx, decode_blocks, decode_seq_lens,
                   decode_len, prefills)

    @classmethod
    def for_decode(cls, seq_lens: np.ndarray, tables: np.ndarray, slots: np.ndarray, block_size: int,
                   device: torch.device) -> "AttentionMetadata":
        """What `build` gives for a step of decode rows only (one query token each), from host arrays:
        seq_lens [rows] (int64), tables [rows, ceil(max(seq_lens) / block_size)] (the rows' block ids;
        padding may be -1) and slots [rows] (each row's new token's cache slot).

        Why: a decode step's inputs are prepared just after the model has streamed its weights through
        the caches, where each torch call of `build` (a clamp, a dtype change, a list to a tensor, a view)
        costs tens of microseconds: at one request they were about a third of the step's preparation.
        Here they are a few numpy expressions and one conversion per field."""
        rows = len(seq_lens)
        per_row = tables.shape[1]
        blocks = np.maximum(tables, 0).astype(np.int64).reshape(-1)  # padding is masked, never read
        lens = seq_lens.tolist()
        host = device.type == "cpu"  # then the arrays' own memory: `.to` is a call that changes nothing

        def put(a: np.ndarray) -> Tensor:
            return torch.from_numpy(a) if host else torch.from_numpy(a).to(device)

        return cls([1] * rows, lens, put(tables), put(slots), block_size, rows, True, None, put(blocks),
                   put(seq_lens), per_row * block_size, [])

    def token_rows(self) -> "TokenRows":
        """Every token of the step as a decode row of its own (its context: its sequence's positions up
        to and including its own), for attention that treats prefill and decode tokens alike."""
        key = ("token_rows",)
        if key not in self._memo:
            device = self.block_tables.device
            per_row = -(-max(self.seq_lens) // self.block_size)
            counts = torch.tensor(self.query_lens, device=device)
            tables = self.block_tables[:, :per_row].clamp(min=0).long()
            lens = torch.tensor([p for q, s in zip(self.query_lens, self.seq_lens) for p in range(s - q + 1, s + 1)],
                                dtype=torch.int64, device=device)
            blocks = tables.repeat_interleave(counts, dim=0).contiguous().view(-1)
            self._memo[key] = TokenRows(self.slot_mapping, blocks, lens, per_row * self.block_size)
        return self._memo[key]

    def decode_kv_index(self, num_blocks: int) -> Tensor:
        """Rows of the cache viewed as [2 * num_blocks, block_size * kv_heads * dim] holding the decode
        rows' K blocks then V blocks: one dim-0 index_select (the fastest gather) fetches both."""
        key = ("kv_index", num_blocks)
        if key not in self._memo:
            assert self.decode_blocks is not None
            self._memo[key] = torch.cat((self.decode_blocks, self.decode_blocks + num_blocks))
        return self._memo[key]

    def scratch(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
        """A buffer reused by every layer of this step (layers run one after another)."""
        key = ("scratch", shape, dtype, device)
        if key not in self._memo:
            self._memo[key] = torch.empty(shape, dtype=dtype, device=device)
        return self._memo[key]

    def decode_mask(self, dtype: torch.dtype, window: int | None) -> Tensor | None:
        """Additive mask (0 / -inf) [num_decode, 1, 1, decode_len] for the padded decode gather; None
        where no masking is needed. Built once per step, and only by a backend that reads it."""
        key = ("decode_mask", dtype, window)
        if key not in self._memo:
            self._memo[key] = self._decode_mask(dtype, window)
        return self._memo[key]

    def prefill_masks(self, dtype: torch.dtype, window: int | None) -> list[Tensor | None]:
        """One additive mask [q, k] per prefill chunk; None where plain causal masking is exact."""
        key = ("prefill_masks", dtype, window)
        if key not in self._memo:
            self._memo[key] = [self._prefill_mask(c, dtype, window) for c in self.prefills]
        return self._memo[key]

    def _decode_mask(self, dtype: torch.dtype, window: int | None) -> Tensor | None:
        lens = self.decode_seq_lens
        if lens is None:
            return None
        if window is None and bool((lens == self.decode_len).all()):
            return None
        j = torch.arange(self.decode_len, device=lens.device)
        allowed = j[None, :] < lens[:, None]
        if window is not None:
            allowed &= j[None, :] >= (lens[:, None] - window)
        return _additive(allowed, dtype).view(len(lens), 1, 1, self.decode_len)

    def _prefill_mask(self, c: PrefillChunk, dtype: torch.dtype, window: int | None) -> Tensor | None:
        if c.cached == 0 and window is None:
            return None  # square causal: SDPA's is_causal is exact
        device = self.block_tables.device
        qpos = torch.arange(c.cached, c.seq_len, device=device)[:, None]
        kpos = torch.arange(0, c.seq_len, device=device)[None, :]  # fresh rows (cached == 0) start at 0 too
        allowed = kpos <= qpos
        if window is not None:
            allowed &= kpos > qpos - window
        return _additive(allowed, dtype)


@dataclass(frozen=True)
class TokenRows:
    """Every token of a step as a decode row (forerun.kernels.types.DecodeBatch): `decode_blocks` holds
    `decode_len // block_size` block ids per token, `decode_seq_lens` each token's context length."""

    slot_mapping: Tensor
    decode_blocks: Tensor
    decode_seq_lens: Tensor
    decode_len: int
    all_decode: bool = True


def _additive(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    # A float mask is measurably faster than a bool one in CPU SDPA.
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _validate(query_lens: list[int], seq_lens: list[int], block_tables: Tensor, slot_mapping: Tensor,
              block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size: must be >= 1, got {block_size}")
    if len(query_lens) != len(seq_lens) or not query_lens:
        raise ValueError(f"query_lens/seq_lens: need equal, non-zero lengths, got {len(query_lens)} and {len(seq_lens)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != len(query_lens):
        raise ValueError(f"block_tables: expected [{len(query_lens)}, max_blocks], got {tuple(block_tables.shape)}")
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        if not 1 <= q <= s:
            raise ValueError(f"query_lens[{i}]/seq_lens[{i}]: need 1 <= query_len <= seq_len, got {q}, {s}")
    if -(-max(seq_lens) // block_size) > block_tables.shape[1]:
        raise ValueError(f"block_tables: {block_tables.shape[1]} columns cannot hold seq_len {max(seq_lens)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != sum(query_lens):
        raise ValueError(f"slot_mapping: expected [{sum(query_lens)}], got {tuple(slot_mapping.shape)}")


def write_kv(k: Tensor, v: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> Tensor:
    """The new tokens' K and V [T, kv_heads, d] into one layer's cache at their slots; returns the cache
    viewed as [2, slots, kv_heads, d]."""
    flat = kv_cache.view(2, -1, k.shape[1], k.shape[2])
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)
    return flat


class AttentionBackend(Protocol):
    """Writes the new tokens' K/V into the paged cache, then attends each query over its context."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMetadata,
                scale: float, window: int | None) -> Tensor:
        """q [T, heads, d], k/v [T, kv_heads, d], kv_cache one layer -> [T, heads * d]."""
        ...


class TorchSDPABackend:
    """Paged attention from stock PyTorch ops (`scaled_dot_product_attention`), any device.

    Decode rows: one gather of whole blocks and one SDPA call for all of them; GQA is folded into
    the query length (each KV head's query group becomes a length-`group` query), so no K/V
    expansion is needed. Prefill rows: one SDPA call per row.
    """

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMetadata,
                scale: float, window: int | None) -> Tensor:
        num_tokens, heads, dim = q.shape
        flat = write_kv(k, v, kv_cache, meta.slot_mapping)
        if meta.all_decode:
            return self._decode(q, kv_cache, meta, scale, window)
        out = q.new_empty(num_tokens, heads * dim)
        if meta.decode_token_idx is not None:
            dq = q.index_select(0, meta.decode_token_idx)
            out.index_copy_(0, meta.decode_token_idx, self._decode(dq, kv_cache, meta, scale, window))
        for chunk, mask in zip(meta.prefills, meta.prefill_masks(q.dtype, window)):
            qi = q[chunk.start:chunk.end].transpose(0, 1).unsqueeze(0)
            if chunk.slots is None:
                ki, vi = k[chunk.start:chunk.end], v[chunk.start:chunk.end]
            else:
                ki, vi = flat.index_select(1, chunk.slots).unbind(0)
            res = F.scaled_dot_product_attention(
                qi, ki.transpose(0, 1).unsqueeze(0), vi.transpose(0, 1).unsqueeze(0),
                attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=heads != k.shape[1])
            out[chunk.start:chunk.end] = res[0].transpose(0, 1).reshape(chunk.end - chunk.start, heads * dim)
        return out

    def _decode(self, q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
                window: int | None) -> Tensor:
        """Decode rows attended together over their gathered, padded K/V."""
        assert meta.decode_blocks is not None
        _, num_blocks, block_size, kv_heads, dim = kv_cache.shape
        rows, heads = q.shape[0], q.shape[1]
        # Gathering whole blocks copies large contiguous rows: far cheaper than per-slot indexing.
        # Reuse one gather buffer across the step's layers: a fresh multi-MB tensor per layer costs
        # page faults that measured about as much as the copy itself.
        index = meta.decode_kv_index(num_blocks)
        cache_rows = kv_cache.view(2 * num_blocks, -1)
        ctx = meta.scratch((index.shape[0], cache_rows.shape[1]), kv_cache.dtype, kv_cache.device)
        torch.index_select(cache_rows, 0, index, out=ctx)
        ctx = ctx.view(2, rows, meta.decode_len, kv_heads, dim).transpose(2, 3)
        qg = q.view(rows, kv_heads, heads // kv_heads, dim)
        mask = meta.decode_mask(q.dtype, window)
        res = F.scaled_dot_product_attention(qg, ctx[0], ctx[1], attn_mask=mask, scale=scale)
        return res.reshape(rows, heads * dim)


class NativeDecodeBackend(TorchSDPABackend):
    """Stock-PyTorch attention for prefill rows; decode rows go to the C kernel when it can run them
    (see `DecodeAttention.accepts`); anything else falls back to the stock path.

    `batch_invariant`: every token, prefill and decode alike, is one row of the C kernel with its
    context cut into parts by its own length alone, so a token's result depends on its own sequence
    only: not on the other rows, on how its prompt was chunked, or on whether its prefix came from the
    cache. The caller checks that
    the kernel takes the model's shape (`forerun.kernels.attention.shape_supported`)."""

    def __init__(self, lib: ctypes.CDLL, batch_invariant: bool = False) -> None:
        self.lib = lib
        self.attention = DecodeAttention(lib)
        self.batch_invariant = batch_invariant

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMetadata,
                scale: float, window: int | None) -> Tensor:
        if not self.batch_invariant:
            return super().forward(q, k, v, kv_cache, meta, scale, window)
        if not self.attention.accepts(q, kv_cache):
            raise ValueError(f"batch_invariant: the C attention kernel does not take q {q.dtype} "
                             f"{tuple(q.shape)} over a {kv_cache.dtype} cache")
        write_kv(k, v, kv_cache, meta.slot_mapping)
        return self.attention(q, kv_cache, meta.token_rows(), scale, window, split=False)

    def _decode(self, q: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float,
                window: int | None) -> Tensor:
        if not self.attention.accepts(q, kv_cache):
            return super()._decode(q, kv_cache, meta, scale, window)
        return self.attention(q, kv_cache, meta, scale, window)

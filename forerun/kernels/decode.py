"""A decode step of a few rows through every decoder layer in one C call (`csrc/decode_layers.c`).

At one to a few decode rows each op of a layer takes microseconds, and dispatching the ~15 Python
and torch calls per layer costs as much as the arithmetic. `DecodeLayers` hands C the same kernels
and arguments the layer-by-layer path uses (the compact-weight GEMV, fused norm, rotary, paged decode
attention, activation), so the hidden states are the same bit for bit. It is built only where every
layer can run that way (the model decides, from `DecodeLayers.shape_supported` and its own modules);
everything else (prefill, larger batches, other dtypes or devices, tensor or pipeline parallelism)
keeps the module path. `enforce_eager` turns it off. It is handed the layers' weights and sizes as
plain data (`DecodeLayerWeights`, `DecodeDims`) and knows no model class.

In an fp32 engine given the model's ends (`DecodeEnds`: embedding, rotary table, final norm, LM
head), `step` runs the whole step from token ids to the final-norm hidden states and the logits in
that one call (`logits_of` hands the logits to the model): after the layers have streamed the
weights through the caches, the few torch calls around them ran cold, at 10-20 times their warm time
(see `csrc/decode_layers.c`).

In a bf16 engine (`kv_dtype` bf16) the step runs in fp32 with a bf16 KV cache: the hidden states and
norm weights convert to fp32 at the call (exact), the cache holds bf16 as the module path's does, and
the result rounds back to bf16. It then equals the bf16 module path within bf16 rounding only (the
module path rounds after every op).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from forerun.kernels.attention import shape_supported
from forerun.kernels.build import profiled
from forerun.kernels.block_linear import JoinedGemv, Small
from forerun.kernels.block_matmul import OrderedGemv
from forerun.kernels.compact_weights import CompactWeight
from forerun.kernels.gemv import CompactLinear
from forerun.kernels.kquant_gemv import FORMATS
from forerun.kernels.ops import PARALLEL_MIN_ELEMENTS
from forerun.kernels.types import DecodeBatch

_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
# Steps of up to this many rows also give greedy sampling its ids (`greedy_of`): a row's argmax
# costs microseconds in the step, while the logits are in cache, against 80-100 us for the sampler's
# own call just after (one request, Intel Xeon: the call's code and the logits had gone cold). Rows
# that do not sample greedily waste it, so larger steps leave it to the sampler.
GREEDY_MAX_ROWS = 8


@dataclass(frozen=True)
class DecodeLayerWeights:
    """One pre-norm decoder layer as the fused step reads it: four compact-weight matmuls (q/k/v packed,
    output, gate/up packed, down), the two RMSNorm weights (fp32 or bf16; `DecodeLayers` keeps fp32
    copies) and the sliding window (None: full attention). The model builds these from its own
    modules; the tensors stay owned by it."""

    qkv: Small
    o: Small
    gate_up: Small
    down: Small
    input_norm: Tensor
    post_norm: Tensor
    window: int | None


@dataclass(frozen=True)
class DecodeDims:
    """The sizes every layer shares: hidden and (per-matmul) intermediate width, query and KV heads,
    head_dim, the RMSNorm epsilon and the attention scale."""

    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    scale: float


@dataclass(frozen=True)
class DecodeEnds:
    """What a whole step adds around the layers (fp32 engines): the embedding table, as GGUF blocks
    (`embed` a CompactWeight in a format the block kernels read, or bf16) or a dense fp32 tensor
    [vocab, hidden]; the rotary table [positions, 2 * head_dim] (cos factors, then sin factors); the
    final norm's fp32 weight; the LM head's compact-weight matmul for up to `head_rows` rows (None: the
    model computes the logits). The model keeps the tensors alive."""

    embed: CompactWeight | Tensor
    rotary: Tensor
    final_norm: Tensor
    head: Small | None = None
    head_rows: int = 0

    def supported(self) -> bool:
        """Whether the C step reads these tables (else the model's own modules run them)."""
        embed = self.embed
        if isinstance(embed, CompactWeight):
            table = embed.fmt in ("bf16", *FORMATS) and embed.data.is_contiguous()
        else:
            table = embed.dtype == torch.float32 and embed.dim() == 2 and embed.is_contiguous()
        return (table and self.rotary.dtype == torch.float32 and self.rotary.is_contiguous()
                and self.final_norm.dtype == torch.float32 and self.final_norm.is_contiguous())


MAX_PARTS = 3  # decode_layers.c: parts of one packed matmul in their own formats (q, k, v)


class _Matmul(ctypes.Structure):
    _fields_ = [("parts", _I64), ("w", _PTR * MAX_PARTS), ("group_bytes", _I64 * MAX_PARTS),
                ("fmt", _I64 * MAX_PARTS), ("n", _I64 * MAX_PARTS), ("bias", _PTR)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Matmul), ("o", _Matmul), ("gate_up", _Matmul), ("down", _Matmul),
                ("input_norm", _PTR), ("post_norm", _PTR), ("kv_cache", _PTR), ("window", _I64)]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", _I64), ("inter", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64),
                ("num_blocks", _I64), ("block_size", _I64), ("eps", _F32), ("scale", _F32),
                ("parallel_min_elements", _I64), ("split", _I64)]


class _Batch(ctypes.Structure):
    _fields_ = [("rows", _I64), ("cos", _PTR), ("sin", _PTR), ("cos_sin_stride", _I64), ("slots", _PTR),
                ("tables", _PTR), ("table_stride", _I64), ("lens", _PTR), ("max_len", _I64)]


class _Ends(ctypes.Structure):
    _fields_ = [("ids", _PTR), ("positions", _PTR), ("embed", _PTR), ("embed_fmt", _I64), ("embed_rows", _I64),
                ("embed_row_bytes", _I64), ("rotary", _PTR), ("rotary_rows", _I64), ("final_norm", _PTR),
                ("head", _PTR), ("head_n", _I64), ("greedy", _PTR)]


TABLE_F32, TABLE_BF16 = -1, -2  # decode_layers.c: an embedding of plain fp32 or bf16 rows


def _ends(ends: DecodeEnds) -> _Ends:
    """The C view of `ends`, ids and positions unset."""
    embed = ends.embed
    if isinstance(embed, CompactWeight):
        fmt = TABLE_BF16 if embed.fmt == "bf16" else FORMATS[embed.fmt].code
        table, row_bytes = embed.data, embed.data.shape[1]
    else:
        fmt, table, row_bytes = TABLE_F32, embed, embed.shape[1] * 4
    return _Ends(embed=table.data_ptr(), embed_fmt=fmt, embed_rows=table.shape[0], embed_row_bytes=row_bytes,
                 rotary=ends.rotary.data_ptr(), rotary_rows=ends.rotary.shape[0],
                 final_norm=ends.final_norm.data_ptr())


BLOCK_FMT = 256  # decode_layers.c: a format code at or above it names the block GEMV's ggml type
# decode_layers.c: ... the GEMV over 8- or 16-bit activations (the activation_bits setting)
INT_FMTS = {8: 768, 16: 1024}


def _matmul(lin: Small) -> _Matmul:
    bias = None if lin.bias is None else lin.bias.data_ptr()
    m = _Matmul(parts=1, bias=bias)
    if isinstance(lin, CompactLinear):
        m.w[0], m.group_bytes[0], m.fmt[0], m.n[0] = lin.packed.data_ptr(), lin.packed.shape[1], lin.code, lin.n
        return m
    parts = lin.parts if isinstance(lin, JoinedGemv) else (lin,)
    if len(parts) > MAX_PARTS:
        raise ValueError(f"parts: the fused decode step takes at most {MAX_PARTS} parts a matmul, got {len(parts)}")
    m.parts = len(parts)
    for i, part in enumerate(parts):
        if isinstance(part.gemv, OrderedGemv):  # bf16 batch invariance, which runs layer by layer
            raise ValueError("parts: the fused decode step runs fp32 only; the ordered bf16 GEMV is not in it")
        blocks = part.gemv.blocks
        base = INT_FMTS.get(part.gemv.activation_bits, BLOCK_FMT)
        m.w[i], m.group_bytes[i], m.fmt[i], m.n[i] = blocks.data_ptr(), blocks.shape[1], base + part.gemv.code, part.n
    return m


class DecodeLayers:
    """Runs all decoder layers of one model for decode batches of at most `max_rows` rows; build it
    only where `shape_supported(dims)` holds and every layer has compact-weight matmuls, fused C norms
    and activation, and C decode attention (the model checks its own side)."""

    def __init__(self, lib: ctypes.CDLL, layers: Sequence[DecodeLayerWeights], dims: DecodeDims,
                 max_rows: int, kv_dtype: torch.dtype = torch.float32, split: bool = True,
                 ends: DecodeEnds | None = None) -> None:
        if kv_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"kv_dtype: the fused decode step takes a float32 or bfloat16 cache, not {kv_dtype}")
        self.fn = lib.decode_layers_f32 if kv_dtype == torch.float32 else lib.decode_layers_bf16
        self._step_fn = lib.decode_step_f32
        self.dtype = kv_dtype
        self.max_rows = max_rows
        self.split = split  # False: attention never splits a context (batch-invariant mode)
        self.heads, self.kv_heads, self.head_dim = dims.heads, dims.kv_heads, dims.head_dim
        self.hidden, self.inter = dims.hidden, dims.inter
        self.eps, self.scale = dims.eps, dims.scale
        self._layers = (_Layer * len(layers))()
        # fp32 norm weights (the layer's own tensors when fp32; exact copies of bf16 ones), kept alive here.
        self._norms = [(layer.input_norm.float().contiguous(), layer.post_norm.float().contiguous()) for layer in layers]
        for slot, layer, (input_norm, post_norm) in zip(self._layers, layers, self._norms):
            slot.qkv, slot.o, slot.gate_up, slot.down = (
                _matmul(lin) for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
            slot.input_norm = input_norm.data_ptr()
            slot.post_norm = post_norm.data_ptr()
            slot.window = layer.window or 0
        # The engine allocates the caches once: their pointers and shape are written on first use and
        # again only for other cache tensors. Why by identity: reading 30 layers' pointers and checking
        # each step's caches cost ~100 us a step at one request, where the step's host work runs cold.
        # Holding the tensors (not their ids, which a new tensor may reuse) keeps the match sound.
        self._caches: list[Tensor] = []
        self._caches_ok = False  # the caches are of this step's dtype and contiguous
        self._shape = _Shape()
        # The whole step's scratch (hidden and residual, [max_rows, hidden] each), allocated at its first use.
        self._scratch: Tensor | None = None
        self._scratch_at = (0, 0)  # its two halves' addresses
        # The whole step from token ids (fp32 engines whose embedding table the C step reads).
        self.ends = ends if ends is not None and ends.supported() and kv_dtype == torch.float32 else None
        self._ends = None if self.ends is None else _ends(self.ends)
        self._head = None if self.ends is None or self.ends.head is None else _matmul(self.ends.head)
        self._last: tuple[Tensor, Tensor, Tensor | None] | None = None  # the last step's (hidden, logits, ids)
        self._greedy: tuple[Tensor, Tensor] | None = None  # logits handed over by logits_of, and their argmax

    @staticmethod
    def shape_supported(dims: DecodeDims) -> bool:
        """Whether the C decode attention inside the fused step takes this attention shape."""
        return shape_supported(dims.heads, dims.kv_heads, dims.head_dim)

    def _takes(self, rows: int, kv_caches: list[Tensor], meta: DecodeBatch) -> bool:
        """The conditions on the batch and the caches that both entries share."""
        return (meta.all_decode and rows <= self.max_rows and self._use_caches(kv_caches)
                and meta.decode_blocks is not None and meta.slot_mapping.is_contiguous())

    def _use_caches(self, kv_caches: list[Tensor]) -> bool:
        """Whether the C path takes these caches (this dtype, contiguous); their pointers and shape are
        written into the layers whenever other cache tensors come."""
        if len(kv_caches) != len(self._caches) or any(a is not b for a, b in zip(kv_caches, self._caches)):
            first = kv_caches[0]
            self._caches_ok = all(c.dtype == self.dtype and c.is_contiguous() for c in kv_caches)
            _, num_blocks, block_size, _, _ = first.shape
            for slot, cache in zip(self._layers, kv_caches):
                slot.kv_cache = cache.data_ptr()
            self._caches = list(kv_caches)
            self._shape = _Shape(self.hidden, self.inter, self.heads, self.kv_heads, self.head_dim, num_blocks,
                                 block_size, self.eps, self.scale, PARALLEL_MIN_ELEMENTS, int(self.split))
        return self._caches_ok

    def accepts(self, hidden: Tensor, cos: Tensor, sin: Tensor, kv_caches: list[Tensor],
                meta: DecodeBatch) -> bool:
        """Whether this step's inputs are ones the C path takes (else the caller runs the modules)."""
        return (self._takes(hidden.shape[0], kv_caches, meta) and hidden.dtype == self.dtype
                and hidden.is_contiguous()
                and cos.stride(-1) == 1 and sin.stride(-1) == 1 and cos.stride(0) == sin.stride(0)
                and cos.dtype == sin.dtype and cos.dtype in (torch.float32, self.dtype))

    def accepts_ids(self, input_ids: Tensor, positions: Tensor, kv_caches: list[Tensor],
                    meta: DecodeBatch) -> bool:
        """Whether `step` takes this step (else the caller embeds and runs `__call__` or the modules).
        `ends` is set only in an fp32 engine, so the caches are fp32 here."""
        return (self.ends is not None and self._takes(input_ids.shape[0], kv_caches, meta)
                and input_ids.dtype == torch.int64 and positions.dtype == torch.int64
                and input_ids.is_contiguous() and positions.is_contiguous() and input_ids.device.type == "cpu")

    def _batch(self, rows: int, kv_caches: list[Tensor], meta: DecodeBatch, cos: Tensor | None = None,
               sin: Tensor | None = None) -> _Batch:
        """The C view of this step's batch (cache pointers and shape refreshed when they changed)."""
        self._use_caches(kv_caches)
        block_size = self._shape.block_size
        assert meta.decode_blocks is not None and meta.decode_seq_lens is not None
        return _Batch(rows, 0 if cos is None else cos.data_ptr(), 0 if sin is None else sin.data_ptr(),
                      0 if cos is None else cos.stride(0), meta.slot_mapping.data_ptr(),
                      meta.decode_blocks.data_ptr(), meta.decode_len // block_size, meta.decode_seq_lens.data_ptr(),
                      meta.decode_len)

    def step(self, input_ids: Tensor, positions: Tensor, kv_caches: list[Tensor], meta: DecodeBatch) -> Tensor:
        """The final-norm hidden states [rows, hidden_size] of a decode step from its token ids and
        positions [rows] (int64): what the model's embedding, this step's layers and the final norm
        give, bit for bit. Only where `accepts_ids` holds. ValueError names an id or position outside
        the model's tables."""
        assert self._ends is not None and self.ends is not None
        rows = input_ids.shape[0]
        batch = self._batch(rows, kv_caches, meta)
        ends = self._ends
        ends.ids, ends.positions = input_ids.data_ptr(), positions.data_ptr()
        head = self._head is not None and rows <= self.ends.head_rows
        ends.head, ends.head_n = (ctypes.addressof(self._head), self.ends.head.n) if head else (None, 0)
        out, logits = torch.empty(rows, self.hidden), torch.empty(rows, ends.head_n)
        if self._scratch is None:
            self._scratch = torch.empty(2, self.max_rows, self.hidden)
            self._scratch_at = (self._scratch[0].data_ptr(), self._scratch[1].data_ptr())
        hidden, residual = self._scratch_at
        greedy = torch.empty(rows, dtype=torch.int64) if head and rows <= GREEDY_MAX_ROWS else None
        ends.greedy = None if greedy is None else greedy.data_ptr()
        self._last, self._greedy = None, None
        with profiled("forerun::decode_step"):
            failed = self._step_fn(self._layers, len(self._layers), ctypes.byref(self._shape), ctypes.byref(batch),
                                   ctypes.byref(ends), out.data_ptr(), logits.data_ptr(), hidden, residual,
                                   torch.get_num_threads())
        if failed == 3:
            raise ValueError(f"input_ids: a token id outside the vocabulary of {ends.embed_rows}")
        if failed == 5:
            raise ValueError(f"positions: a position at or past the rotary table's {ends.rotary_rows}")
        if failed:
            raise RuntimeError(f"decode step: the C kernels failed (code {failed})")
        self._last = (out, logits, greedy) if head else None
        return out

    def logits_of(self, hidden: Tensor) -> Tensor | None:
        """The LM head's logits of `hidden` when it is the last `step`'s output (that call computed
        them; this hands them over once), else None."""
        last, self._last = self._last, None
        if last is None or last[0] is not hidden:
            return None
        self._greedy = None if last[2] is None else (last[1], last[2])
        return last[1]

    def greedy_of(self, logits: Tensor) -> Tensor | None:
        """Each row's argmax (int64 [rows], as torch.argmax gives it) of `logits` when they are the
        last logits `logits_of` handed over and the step computed it (at most GREEDY_MAX_ROWS rows);
        handed over once, else None."""
        greedy, self._greedy = self._greedy, None
        return greedy[1] if greedy is not None and greedy[0] is logits else None

    def __call__(self, hidden: Tensor, cos: Tensor, sin: Tensor, kv_caches: list[Tensor],
                 meta: DecodeBatch) -> tuple[Tensor, Tensor]:
        """(hidden, residual) after the last layer, from the embedded tokens `hidden` [rows, hidden_size]
        (updated in place when fp32)."""
        out_dtype = hidden.dtype
        if out_dtype != torch.float32:  # exact: the C step runs in fp32 (see the module docstring)
            hidden = hidden.float()
            cos, sin = cos.float().contiguous(), sin.float().contiguous()
        batch = self._batch(hidden.shape[0], kv_caches, meta, cos, sin)
        residual = torch.empty_like(hidden)
        with profiled("forerun::decode_layers"):
            failed = self.fn(self._layers, len(self._layers), ctypes.byref(self._shape), ctypes.byref(batch),
                             hidden.data_ptr(), residual.data_ptr(), torch.get_num_threads())
        if failed:
            raise RuntimeError(f"decode layers: the C kernels failed (code {failed})")
        return hidden.to(out_dtype), residual.to(out_dtype)

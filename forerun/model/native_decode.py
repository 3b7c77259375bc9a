"""A decode step of a few rows through every decoder layer in one C call (`native/decode_layers.c`).

At one to a few decode rows each op of a layer takes microseconds, and dispatching the ~15 Python
and torch calls per layer costs as much as the arithmetic. `DecodeLayers` hands C the same kernels
and arguments the layer-by-layer path uses (the compact-weight GEMV, fused norm, rotary, paged decode
attention, activation), so the hidden states are the same bit for bit. It is built only where every
layer can run that way (see `DecodeLayers.build`); everything else (prefill, larger batches, other
dtypes or devices, tensor or pipeline parallelism) keeps the module path. `enforce_eager` turns it off.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from forerun.model.attention import AttentionMetadata
from forerun.model.native_attention import MAX_GROUP, MAX_HEADS, NativeDecodeBackend
from forerun.model.native_build import profiled
from forerun.model.native_gemv import CompactLinear

if TYPE_CHECKING:
    from forerun.model.llama import LlamaForCausalLM

_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class _Matmul(ctypes.Structure):
    _fields_ = [("w", _PTR), ("group_bytes", _I64), ("fmt", _I64), ("bias", _PTR)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Matmul), ("o", _Matmul), ("gate_up", _Matmul), ("down", _Matmul),
                ("input_norm", _PTR), ("post_norm", _PTR), ("kv_cache", _PTR), ("window", _I64)]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", _I64), ("inter", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64),
                ("num_blocks", _I64), ("block_size", _I64), ("eps", _F32), ("scale", _F32)]


class _Batch(ctypes.Structure):
    _fields_ = [("rows", _I64), ("cos", _PTR), ("sin", _PTR), ("cos_sin_stride", _I64), ("slots", _PTR),
                ("tables", _PTR), ("table_stride", _I64), ("lens", _PTR), ("max_len", _I64)]


def _matmul(lin: CompactLinear) -> _Matmul:
    bias = None if lin.bias is None else lin.bias.data_ptr()
    return _Matmul(lin.packed.data_ptr(), lin.packed.shape[1], lin.code, bias)


class DecodeLayers:
    """Runs all decoder layers of one model for decode batches of at most `max_rows` rows."""

    def __init__(self, lib: ctypes.CDLL, model: LlamaForCausalLM, max_rows: int) -> None:
        self.fn = lib.decode_layers_f32
        self.model = model
        self.max_rows = max_rows
        args, layers = model.args, [model.model.layers[i] for i in model.local_layers]
        attn = layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.hidden, self.inter = args.hidden_size, layers[0].mlp.inter
        self.eps, self.scale = args.rms_norm_eps, attn.scale
        self._layers = (_Layer * len(layers))()
        for slot, layer in zip(self._layers, layers):
            a, mlp = layer.self_attn, layer.mlp
            slot.qkv, slot.o = _matmul(a.qkv_proj.small), _matmul(a.o_proj.small)
            slot.gate_up, slot.down = _matmul(mlp.gate_up_proj.small), _matmul(mlp.down_proj.small)
            slot.input_norm = layer.input_layernorm.weight.data_ptr()
            slot.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            slot.window = a.window or 0
        self._caches: list[int] = []  # the cache pointers last written into the layer slots

    @classmethod
    def why_not(cls, model: LlamaForCausalLM) -> str | None:
        """Why the model's layers cannot run as one C call (None when they can)."""
        if model.tp.size != 1 or not (model.pp.is_first and model.pp.is_last):
            return "tensor or pipeline parallelism"
        if model.args.qk_norm:
            return "per-head q/k norms"
        layers = [model.model.layers[i] for i in model.local_layers]
        for layer in layers:
            a, mlp = layer.self_attn, layer.mlp
            linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(lin.small is None for lin in linears):
                return "a matmul without a compact-weight form"
            if a.native is None or mlp.native is None or layer.input_layernorm.native is None:
                return "no fused C ops"
            if not isinstance(a.backend, NativeDecodeBackend):
                return "attention not in C"
            if layer.input_layernorm.weight.dtype != torch.float32:
                return "not fp32"
        a = layers[0].self_attn
        if a.num_heads // a.num_kv_heads > MAX_GROUP or a.num_heads > MAX_HEADS or a.head_dim % 8:
            return "an attention shape the C kernel lacks"
        return None

    @classmethod
    def build(cls, lib: ctypes.CDLL, model: LlamaForCausalLM) -> DecodeLayers | None:
        """The fused step for `model` (after `use_linear_kernel`), or None where `why_not` answers."""
        if cls.why_not(model) is not None:
            return None
        layers = [model.model.layers[i] for i in model.local_layers]
        rows = min(lin.small_rows for layer in layers
                   for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                               layer.mlp.down_proj))
        return cls(lib, model, rows) if rows > 0 else None

    def accepts(self, hidden: Tensor, cos: Tensor, sin: Tensor, kv_caches: list[Tensor],
                meta: AttentionMetadata) -> bool:
        """Whether this step's inputs are ones the C path takes (else the caller runs the modules)."""
        first = kv_caches[0]
        return (meta.all_decode and hidden.shape[0] <= self.max_rows and hidden.dtype == torch.float32
                and hidden.is_contiguous() and first.dtype == torch.float32 and first.is_contiguous()
                and cos.stride(-1) == 1 and sin.stride(-1) == 1 and cos.stride(0) == sin.stride(0)
                and cos.dtype == torch.float32 and meta.decode_blocks is not None
                and meta.slot_mapping.is_contiguous())

    def __call__(self, hidden: Tensor, cos: Tensor, sin: Tensor, kv_caches: list[Tensor],
                 meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
        """(hidden, residual) after the last layer, from the embedded tokens `hidden` [rows, hidden_size]
        (updated in place)."""
        caches = [c.data_ptr() for c in kv_caches]
        if caches != self._caches:  # the engine allocates caches once; re-point only when they change
            for slot, ptr in zip(self._layers, caches):
                slot.kv_cache = ptr
            self._caches = caches
        _, num_blocks, block_size, _, _ = kv_caches[0].shape
        shape = _Shape(self.hidden, self.inter, self.heads, self.kv_heads, self.head_dim, num_blocks, block_size,
                       self.eps, self.scale)
        assert meta.decode_blocks is not None and meta.decode_seq_lens is not None
        rows = hidden.shape[0]
        batch = _Batch(rows, cos.data_ptr(), sin.data_ptr(), cos.stride(0), meta.slot_mapping.data_ptr(),
                       meta.decode_blocks.data_ptr(), meta.decode_len // block_size, meta.decode_seq_lens.data_ptr(),
                       meta.decode_len)
        residual = torch.empty_like(hidden)
        with profiled("forerun::decode_layers"):
            failed = self.fn(self._layers, len(self._layers), ctypes.byref(shape), ctypes.byref(batch),
                             hidden.data_ptr(), residual.data_ptr(), 0, torch.get_num_threads())
        if failed:
            raise RuntimeError(f"decode layers: the C kernels failed (code {failed})")
        return hidden, residual

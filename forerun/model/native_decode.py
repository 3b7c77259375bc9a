"""A decode step of a few rows through every decoder layer in one C call (`native/decode_layers.c`).

At one to a few decode rows each op of a layer takes microseconds, and dispatching the ~15 Python
and torch calls per layer costs as much as the arithmetic. `DecodeLayers` hands C the same kernels
and arguments the layer-by-layer path uses (the compact-weight GEMV, fused norm, rotary, paged decode
attention, activation), so the hidden states are the same bit for bit. It is built only where every
layer can run that way (see `DecodeLayers.why_not`); everything else (prefill, larger batches, other
dtypes or devices, tensor or pipeline parallelism) keeps the module path. `enforce_eager` turns it off.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from forerun.model.attention import AttentionMetadata
from forerun.model.native_attention import MAX_GROUP, MAX_HEADS, NativeDecodeBackend
from forerun.model.native_build import profiled
from forerun.model.native_gemv import CompactLinear
from forerun.model.native_ops import PARALLEL_MIN_ELEMENTS

if TYPE_CHECKING:
    from forerun.model.layers import PackableLinear
    from forerun.model.llama import LlamaForCausalLM

_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class _Matmul(ctypes.Structure):
    _fields_ = [("w", _PTR), ("group_bytes", _I64), ("fmt", _I64), ("bias", _PTR)]


class _Layer(ctypes.Structure):
    _fields_ = [("qkv", _Matmul), ("o", _Matmul), ("gate_up", _Matmul), ("down", _Matmul),
                ("input_norm", _PTR), ("post_norm", _PTR), ("kv_cache", _PTR), ("window", _I64)]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", _I64), ("inter", _I64), ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64),
                ("num_blocks", _I64), ("block_size", _I64), ("eps", _F32), ("scale", _F32),
                ("parallel_min_elements", _I64)]


class _Batch(ctypes.Structure):
    _fields_ = [("rows", _I64), ("cos", _PTR), ("sin", _PTR), ("cos_sin_stride", _I64), ("slots", _PTR),
                ("tables", _PTR), ("table_stride", _I64), ("lens", _PTR), ("max_len", _I64)]


def _matmul(lin: CompactLinear) -> _Matmul:
    bias = None if lin.bias is None else lin.bias.data_ptr()
    return _Matmul(lin.packed.data_ptr(), lin.packed.shape[1], lin.code, bias)


def _linears(layer: nn.Module) -> tuple[PackableLinear, ...]:
    """A decoder layer's four matmuls, in the order of `_Layer`'s fields."""
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)


class DecodeLayers:
    """Runs all decoder layers of one model for decode batches of at most `max_rows` rows; build it
    only where `why_not` answers None (after `use_linear_kernel`)."""

    def __init__(self, lib: ctypes.CDLL, model: LlamaForCausalLM) -> None:
        self.fn = lib.decode_layers_f32
        args, layers = model.args, [model.model.layers[i] for i in model.local_layers]
        self.max_rows = min(lin.small_rows for layer in layers for lin in _linears(layer))
        attn = layers[0].self_attn
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.hidden, self.inter = args.hidden_size, layers[0].mlp.inter
        self.eps, self.scale = args.rms_norm_eps, attn.scale
        self._layers = (_Layer * len(layers))()
        for slot, layer in zip(self._layers, layers):
            slot.qkv, slot.o, slot.gate_up, slot.down = (_matmul(lin.small) for lin in _linears(layer))
            slot.input_norm = layer.input_layernorm.weight.data_ptr()
            slot.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            slot.window = layer.self_attn.window or 0
        # The engine allocates the caches once: their pointers and shape are written on first use and
        # again only if they change.
        self._caches: list[int] = []
        self._shape = _Shape()

    @staticmethod
    def why_not(model: LlamaForCausalLM) -> str | None:
        """Why the model's layers cannot run as one C call (None when they can)."""
        if model.tp.size != 1 or not (model.pp.is_first and model.pp.is_last):
            return "tensor or pipeline parallelism"
        if model.args.qk_norm:
            return "per-head q/k norms"
        layers = [model.model.layers[i] for i in model.local_layers]
        for layer in layers:
            a, mlp = layer.self_attn, layer.mlp
            if any(lin.small is None for lin in _linears(layer)):
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
        _, num_blocks, block_size, _, _ = kv_caches[0].shape
        if caches != self._caches or num_blocks != self._shape.num_blocks:
            for slot, ptr in zip(self._layers, caches):
                slot.kv_cache = ptr
            self._caches = caches
            self._shape = _Shape(self.hidden, self.inter, self.heads, self.kv_heads, self.head_dim, num_blocks,
                                 block_size, self.eps, self.scale, PARALLEL_MIN_ELEMENTS)
        assert meta.decode_blocks is not None and meta.decode_seq_lens is not None
        rows = hidden.shape[0]
        batch = _Batch(rows, cos.data_ptr(), sin.data_ptr(), cos.stride(0), meta.slot_mapping.data_ptr(),
                       meta.decode_blocks.data_ptr(), meta.decode_len // block_size, meta.decode_seq_lens.data_ptr(),
                       meta.decode_len)
        residual = torch.empty_like(hidden)
        with profiled("forerun::decode_layers"):
            failed = self.fn(self._layers, len(self._layers), ctypes.byref(self._shape), ctypes.byref(batch),
                             hidden.data_ptr(), residual.data_ptr(), torch.get_num_threads())
        if failed:
            raise RuntimeError(f"decode layers: the C kernels failed (code {failed})")
        return hidden, residual

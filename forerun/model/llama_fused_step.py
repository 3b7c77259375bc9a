"""Whether a Llama-family model's decode steps can run as one C call, and that call built from its
modules (forerun.kernels.decode): the model's layers handed over as plain weights and sizes."""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from forerun.kernels.decode import DecodeDims, DecodeEnds, DecodeLayers, DecodeLayerWeights
from forerun.model.attention import NativeDecodeBackend
from forerun.model.layers import PackableLinear


def why_not_fused(model: nn.Module) -> str | None:
    """Why this stage's layers of `model` (a forerun.model.llama model, weights loaded and matmul
    kernels chosen) cannot run as one C call; None when they can."""
    if model.tp.size != 1 or not (model.pp.is_first and model.pp.is_last):
        return "tensor or pipeline parallelism"
    if model.args.qk_norm:
        return "per-head q/k norms"
    for layer in _layers(model):
        a, mlp = layer.self_attn, layer.mlp
        if any(lin.small is None for lin in _linears(layer)):
            return "a matmul without a compact-weight form"
        if a.native is None or mlp.native is None or layer.input_layernorm.native is None:
            return "no fused C ops"
        if not isinstance(a.backend, NativeDecodeBackend):
            return "attention not in C"
        if layer.input_layernorm.weight.dtype not in (torch.float32, torch.bfloat16):
            return "neither fp32 nor bf16"
    if not DecodeLayers.shape_supported(_dims(model)):
        return "an attention shape the C kernel lacks"
    return None


def build_fused_step(model: nn.Module, lib: ctypes.CDLL, split: bool) -> DecodeLayers:
    """The fused step over this stage's layers of `model` (where `why_not_fused` is None). `split`
    False: its attention never splits a context (batch-invariant mode)."""
    layers = _layers(model)
    weights = []
    for layer in layers:
        qkv, o, gate_up, down = (lin.small for lin in _linears(layer))
        assert qkv is not None and o is not None and gate_up is not None and down is not None
        weights.append(DecodeLayerWeights(qkv, o, gate_up, down, layer.input_layernorm.weight,
                                          layer.post_attention_layernorm.weight, layer.self_attn.window))
    max_rows = min(lin.small_rows for layer in layers for lin in _linears(layer))
    kv_dtype = layers[0].input_layernorm.weight.dtype  # the engine's dtype, which its KV cache has
    embed = model.model.embed_tokens
    ends = DecodeEnds(embed.weight if embed.table is None else embed.table, model.model.rotary.table,
                      model.model.norm.weight, model.lm_head.small, model.lm_head.small_rows)
    return DecodeLayers(lib, weights, _dims(model), max_rows, kv_dtype, split, ends)


def _layers(model: nn.Module) -> list[nn.Module]:
    return [model.model.layers[i] for i in model.local_layers]


def _dims(model: nn.Module) -> DecodeDims:
    first = model.model.layers[model.local_layers[0]]
    a = first.self_attn
    return DecodeDims(model.args.hidden_size, first.mlp.inter, a.num_heads, a.num_kv_heads, a.head_dim,
                      model.args.rms_norm_eps, a.scale)


def _linears(layer: nn.Module) -> tuple[PackableLinear, ...]:
    """A decoder layer's four matmuls: q/k/v, output, gate/up, down (the fused step's order)."""
    return (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)

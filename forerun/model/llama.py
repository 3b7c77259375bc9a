"""Llama-family decoder models (Llama, SmolLM2, Mistral, Qwen2, Qwen3) over a paged KV cache."""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any, Iterable

import torch.nn.functional as F
from torch import Tensor, nn

from forerun.kernels.compact_weights import CompactWeight
from forerun.kernels.decode import DecodeLayers
from forerun.kernels.linear import LinearPlan
from forerun.kernels.ops import NativeOps
from forerun.model.attention import AttentionBackend, AttentionMetadata, TorchSDPABackend
from forerun.model.layers import (MergedColumnParallelLinear, PackableLinear, ParallelLMHead, RMSNorm,
                                  RowParallelLinear, VocabParallelEmbedding)
from forerun.model.llama_fused_step import build_fused_step, why_not_fused
from forerun.model.parallel import PPStage, TPGroup
from forerun.model.positions import config_rope_scaling, model_positions
from forerun.model.rotary import RotaryEmbedding
from forerun.model.weight_update import update_in_place

logger = logging.getLogger(__name__)

# HF checkpoint projections that live packed in one of our matmuls: name -> (packed name, part).
_PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


@dataclass(frozen=True)
class LlamaArgs:
    """The config.json fields the Llama family needs, validated; one sliding window per layer."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    windows: tuple[int | None, ...]

    @classmethod
    def from_config(cls, cfg: dict[str, Any], arch: str) -> "LlamaArgs":
        """Read a Hugging Face config.json dict for architecture `arch` (e.g. 'Qwen3ForCausalLM')."""
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act: only silu is supported, got {cfg['hidden_act']!r}")
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias: MLP biases are not supported")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        rope = cfg.get("rope_parameters") or {}  # transformers >= 5 nests rope settings here
        scaling = config_rope_scaling(cfg)
        bias = bool(cfg.get("attention_bias", False))
        family = arch.removesuffix("ForCausalLM")
        return cls(
            vocab_size=int(cfg["vocab_size"]), hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]), num_layers=layers, num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=scaling, max_position=model_positions(cfg) or 4096,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if family == "Qwen2" else bias,
            o_bias=False if family == "Qwen2" else bias,
            qk_norm=family == "Qwen3",
            windows=_windows(cfg, family, layers))


def matmul_shapes(args: LlamaArgs, tp_size: int = 1, logits: bool = True) -> list[tuple[int, int, int]]:
    """(in_features, out_features, count) of every matmul one token passes through on one rank; without
    the vocabulary projection unless `logits` (a prompt token that is not its prompt's last)."""
    d, n = args.head_dim, args.num_layers
    qkv = (args.num_heads + 2 * args.num_kv_heads) * d // tp_size
    layers = [(args.hidden_size, qkv, n), (args.num_heads * d // tp_size, args.hidden_size, n),
              (args.hidden_size, 2 * args.intermediate_size // tp_size, n),
              (args.intermediate_size // tp_size, args.hidden_size, n)]
    return layers + [(args.hidden_size, -(-args.vocab_size // tp_size), 1)] if logits else layers


def _windows(cfg: dict[str, Any], family: str, layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding window (None = full attention), as transformers applies it."""
    window = cfg.get("sliding_window")
    if family == "Mistral":
        return (window,) * layers
    if family in ("Qwen2", "Qwen3") and cfg.get("use_sliding_window") and window:
        types = cfg.get("layer_types")
        if not types:
            first_full = int(cfg.get("max_window_layers", layers))
            types = ["sliding_attention" if i >= first_full else "full_attention" for i in range(layers)]
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (None,) * layers


class LlamaAttention(nn.Module):
    """Packed q/k/v projection, optional per-head q/k RMSNorm (Qwen3), rotary (in C when `native`
    is set), paged attention."""

    native: NativeOps | None = None

    def __init__(self, args: LlamaArgs, tp: TPGroup, backend: AttentionBackend, window: int | None) -> None:
        super().__init__()
        d = args.head_dim
        self.num_heads = tp.shard(args.num_heads, "num_attention_heads")
        self.num_kv_heads = tp.shard(args.num_kv_heads, "num_key_value_heads")
        self.head_dim = d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.scale = d ** -0.5
        self.window = window
        self.backend = backend
        self.qkv_proj = MergedColumnParallelLinear(
            args.hidden_size, [args.num_heads * d, args.num_kv_heads * d, args.num_kv_heads * d], args.qkv_bias, tp)
        self.o_proj = RowParallelLinear(args.num_heads * d, args.hidden_size, args.o_bias, tp)
        self.q_norm = RMSNorm(d, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(d, args.rms_norm_eps) if args.qk_norm else None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, meta: AttentionMetadata) -> Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        qk_end = self.q_size + self.kv_size
        v = qkv[:, qk_end:].view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(qkv[:, : self.q_size].view(n, self.num_heads, self.head_dim))
            k = self.k_norm(qkv[:, self.q_size:qk_end].view(n, self.num_kv_heads, self.head_dim))
            q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        else:
            # q and k share the rotation, so one set of ops (or one C pass) rotates both.
            qk = None if self.native is None else self.native.rotary(qkv[:, :qk_end], cos, sin, self.head_dim)
            if qk is None:
                qk = RotaryEmbedding.apply(qkv[:, :qk_end].view(n, -1, self.head_dim), cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.window)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up packed in one matmul (the activation fused in C
    when `native` is set)."""

    native: NativeOps | None = None

    def __init__(self, args: LlamaArgs, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            args.hidden_size, [args.intermediate_size] * 2, False, tp)
        self.down_proj = RowParallelLinear(args.intermediate_size, args.hidden_size, False, tp)
        self.inter = self.gate_up_proj.sizes[0]

    def forward(self, x: Tensor) -> Tensor:
        gu = self.gate_up_proj(x)
        act = self.native.silu_mul(gu) if self.native is not None else None
        if act is None:
            act = F.silu(gu[:, : self.inter]) * gu[:, self.inter:]
        return self.down_proj(act)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual add is fused into the next norm call."""

    def __init__(self, args: LlamaArgs, tp: TPGroup, backend: AttentionBackend, window: int | None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(args, tp, backend, window)
        self.mlp = LlamaMLP(args, tp)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, hidden: Tensor, residual: Tensor | None, cos: Tensor, sin: Tensor,
                kv_cache: Tensor, meta: AttentionMetadata) -> tuple[Tensor, Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_forward(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm (named as in HF checkpoints under `model.`).

    With pipeline stages only this stage's layers are built; the other indices hold an empty
    placeholder so checkpoint names still map to `layers.<i>`. The embedding lives on the first stage
    (and on the last when the LM head is tied to it), the final norm on the last.
    """

    def __init__(self, args: LlamaArgs, tp: TPGroup, backend: AttentionBackend, pp: PPStage = PPStage()) -> None:
        super().__init__()
        mine = pp.layers(args.num_layers)
        self.layer_range = mine
        want_embed = pp.is_first or (pp.is_last and args.tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp) if want_embed else None
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(args, tp, backend, args.windows[i]) if i in mine else nn.Module()
            for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps) if pp.is_last else None
        self.rotary = RotaryEmbedding(args.head_dim, args.max_position, args.rope_theta, args.rope_scaling)


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM following the `CausalLM` protocol of forerun.model.registry.

    Invariants: `num_kv_heads` is per tensor-parallel rank; `forward` writes every new token's K/V
    into `kv_caches[layer]` at `attn.slot_mapping` before attending; with tied embeddings
    `lm_head.weight` is the embedding's Parameter itself.
    """

    def __init__(self, args: LlamaArgs, tp: TPGroup = TPGroup(),
                 backend: AttentionBackend | None = None, pp: PPStage = PPStage()) -> None:
        super().__init__()
        self.args = args
        self.tp = tp
        self.pp = pp
        self.model = LlamaModel(args, tp, backend or TorchSDPABackend(), pp)
        self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size, tp) if pp.is_last else None
        if args.tie_word_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.num_layers = args.num_layers
        self.local_layers = self.model.layer_range  # the layers this stage runs and keeps a KV cache for
        self.num_kv_heads = tp.shard(args.num_kv_heads, "num_key_value_heads")
        self.head_dim = args.head_dim
        self.vocab_size = args.vocab_size
        self.max_position = args.max_position
        self.decode_layers: DecodeLayers | None = None  # set by use_decode_layers
        # What built the kernels' weight copies, kept so an update in place rebuilds them the same way.
        self.linear_plan: LinearPlan | None = None
        self.decode_kernels: tuple[ctypes.CDLL, bool] | None = None
        self.weights_loaded = False  # after the first full load, load_weights updates in place
        self.packed_modules_mapping = _PACKED  # vLLM's name: HF projection -> (packed module, part)
        self.pending_parts: dict[str, set[int]] = {}  # packed layers part-way through an update

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of ONE layer's cache: (2, num_blocks, block_size, num_kv_heads, head_dim)."""
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[Tensor],
                attn: AttentionMetadata, intermediate: tuple[Tensor, Tensor] | None = None
                ) -> Tensor | tuple[Tensor, Tensor]:
        """Final-norm hidden states [T, hidden] for the flattened batch. A pipeline stage after the first
        starts from the previous stage's (hidden, residual) in `intermediate`; a stage before the last
        returns its own (hidden, residual) instead of normed states."""
        if len(kv_caches) != len(self.local_layers):
            raise ValueError(f"kv_caches: expected {len(self.local_layers)} layers, got {len(kv_caches)}")
        m = self.model
        fused = self.decode_layers  # one C call from token ids to the final norm and logits, where it applies
        if fused is not None and fused.accepts_ids(input_ids, positions, kv_caches, attn):
            return fused.step(input_ids, positions, kv_caches, attn)
        cos, sin = m.rotary.cos_sin(positions)  # shared by every layer
        if self.pp.is_first:
            hidden, residual = m.embed_tokens(input_ids), None
        else:
            if intermediate is None:
                raise ValueError(f"intermediate: stage {self.pp.index} needs the previous stage's activations")
            hidden, residual = intermediate
        if fused is not None and residual is None and fused.accepts(hidden, cos, sin, kv_caches, attn):
            hidden, residual = fused(hidden, cos, sin, kv_caches, attn)
        else:
            for i, cache in zip(self.local_layers, kv_caches):
                hidden, residual = m.layers[i](hidden, residual, cos, sin, cache, attn)
        if not self.pp.is_last:
            return hidden, residual
        return m.norm.add_forward(hidden, residual)[0]

    def use_linear_kernel(self, plan: LinearPlan) -> tuple[int, int]:
        """Run every matmul as the kernels' `plan` builds it (forerun.kernels.linear: the chosen kernel,
        and small inputs over a compact weight where it reads the weight exactly); weights must be loaded.
        Dense weights that only a packed matmul reads are freed; a tied LM head keeps the embedding's.
        Returns (matmuls reading a compact weight for small inputs, all matmuls)."""
        on_gemv = total = 0
        self.linear_plan = plan
        for module in self.modules():
            if isinstance(module, PackableLinear):
                on_gemv += self.use_kernel_for(module, plan)
                total += 1
        return on_gemv, total

    def use_kernel_for(self, module: PackableLinear, plan: LinearPlan) -> bool:
        tied = module is self.lm_head and self.args.tie_word_embeddings
        # fp32 logits from the compact GEMV: `compute_logits` returns fp32, and rounding them to
        # bf16 first makes near-ties exact ties.
        return module.use_kernel(plan, keep_weight=tied, fp32_out=module is self.lm_head)

    def compact_format(self) -> str | None:
        """The compact weight form most matmuls can read: the GGUF blocks' format where the weights are
        blocks, else bf16 where the dense weights are bf16-exact, else None."""
        linears = [m for m in self.modules() if isinstance(m, PackableLinear)]
        forms = [m.blocks[0].fmt for m in linears if m.blocks]
        if forms:
            return max(set(forms), key=forms.count)
        first = next((m for m in linears if m.weight.numel()), None)
        return "bf16" if first is not None and CompactWeight.bf16_of(first.weight.detach()) is not None else None

    def holds_blocks(self) -> bool:
        """Whether any weight is held as GGUF blocks only (its matmuls then need `use_linear_kernel`)."""
        return any(isinstance(m, PackableLinear) and m.blocks for m in self.modules())

    def use_decode_layers(self, lib: ctypes.CDLL, split: bool = True) -> str | None:
        """Run small decode steps through every layer in one C call (forerun.kernels.decode) from
        now on; call after `use_linear_kernel`. Returns why it cannot, or None when it does. `split`
        False: its attention never splits a context (batch-invariant mode)."""
        why = why_not_fused(self)
        self.decode_kernels = (lib, split)
        self.decode_layers = None if why else build_fused_step(self, lib, split)
        return why

    def limit_positions(self, max_model_len: int) -> None:
        """Hold the rotary table for the first `max_model_len` positions (at most the model's): the
        engine never runs past them, and a file's context can far exceed what the KV cache holds (a
        Llama 3.x file's 131,072 positions take 64 MB at head_dim 64). The fused decode step points at
        the table, so it is rebuilt over the new one."""
        if self.model.rotary.resize(max_model_len) and self.decode_kernels is not None:
            self.use_decode_layers(*self.decode_kernels)

    def use_native_ops(self, ops: NativeOps) -> None:
        """Run norms, rotary and the MLP activation through the fused C kernels where they accept the input."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, LlamaMLP, LlamaAttention)):
                module.native = ops

    def compute_logits(self, hidden: Tensor, float32: bool = True) -> Tensor:
        """Full-vocab logits [n, vocab] (gathered over ranks): float32, or with `float32` False in the
        dtype the LM head gives (greedy sampling reads bf16 logits as they are); those of a fused
        step's output come from that step."""
        logits = None if self.decode_layers is None else self.decode_layers.logits_of(hidden)
        if logits is None:
            logits = self.lm_head(hidden)
        return logits.float() if float32 else logits

    def greedy_ids(self, logits: Tensor) -> Tensor | None:
        """Each row's argmax of `logits` (int64 [rows], as torch.argmax gives it) where the fused step
        that computed them computed it too (once per step), else None."""
        return None if self.decode_layers is None else self.decode_layers.greedy_of(logits)

    def load_weights(self, weights: Iterable[tuple[str, Tensor | CompactWeight]]) -> None:
        """Load HF-named tensors: q/k/v and gate/up are packed, tensor-parallel shards are cut here. A
        GGUF file's quantized matrices (CompactWeight) stay blocks, each module deciding how to hold them.
        Once loaded, later calls update in place (forerun.model.weight_update)."""
        if self.weights_loaded:
            update_in_place(self, weights)
            return
        params = dict(self.named_parameters())
        done: dict[str, set[int]] = {}
        for name, tensor in weights:
            if "rotary_emb." in name or (name == "lm_head.weight" and self.args.tie_word_embeddings):
                continue
            if not self._on_this_stage(name):
                continue
            module_path, _, param = name.rpartition(".")
            parent, _, leaf = module_path.rpartition(".")
            part = None
            if leaf in _PACKED:
                leaf, part = _PACKED[leaf]
                module_path = f"{parent}.{leaf}"
            full = f"{module_path}.{param}"
            if full not in params:
                raise ValueError(f"weights: unexpected tensor {name!r} for {type(self).__name__}")
            module = self.get_submodule(module_path)
            if part is not None:
                module.load_weight(param, tensor, part)
            elif hasattr(module, "load_weight"):
                module.load_weight(param, tensor)
            else:
                if isinstance(tensor, CompactWeight):
                    tensor = tensor.expand()  # a matrix no module keeps as blocks
                if tensor.shape != params[full].shape:
                    raise ValueError(f"weights: {name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(params[full].shape)}")
                params[full].data.copy_(tensor)
            done.setdefault(full, set()).add(part or 0)
        self._lm_head_blocks()
        missing = [n for n, _ in self.named_parameters() if len(done.get(n, ())) < _parts(self, n)]
        if missing:
            raise ValueError(f"weights: missing tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        self.weights_loaded = True

    def _lm_head_blocks(self) -> None:
        """An LM head whose table came as blocks multiplies by them: its own, or the embedding's when tied."""
        head = self.lm_head
        if head is None:
            return
        if self.args.tie_word_embeddings and self.model.embed_tokens.table is not None:
            head.table = self.model.embed_tokens.table
            head.weight = self.model.embed_tokens.weight
        if head.table is not None:
            head.blocks = [head.table]


    def _on_this_stage(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to a module this pipeline stage holds."""
        m = self.model
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in self.local_layers
        if name.startswith("model.embed_tokens."):
            return m.embed_tokens is not None
        if name.startswith("model.norm."):
            return m.norm is not None
        if name.startswith("lm_head."):
            return self.lm_head is not None
        return True


def _parts(model: nn.Module, param_name: str) -> int:
    module = model.get_submodule(param_name.rpartition(".")[0])
    return len(module.sizes) if isinstance(module, MergedColumnParallelLinear) else 1


class MistralForCausalLM(LlamaForCausalLM):
    """Llama with an optional sliding window (set per layer from config.json)."""


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama with q/k/v biases."""


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Llama with per-head RMSNorm on q and k before rotary, and no q/k/v bias by default."""

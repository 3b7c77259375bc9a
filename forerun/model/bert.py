"""BERT encoder (e.g. all-MiniLM-L6-v2) for embedding requests.

Encoder-only: there is no KV cache, and attention is bidirectional within each sequence.
Invariant the engine must keep: every sequence handed to `BertModel.forward` is complete
(the whole prompt in one step). The model never sees a chunk of a longer sequence, because
bidirectional attention over a chunk would need the later tokens it has not been given.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor, nn

logger = logging.getLogger(__name__)

_ARCHITECTURES = ("BertModel", "BertForMaskedLM")
_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
# Checkpoint tensors we deliberately drop: the pooler and MLM head are not part of the
# encoder's last hidden state, and position_ids is a buffer, not a weight.
_IGNORED_PREFIXES = ("pooler.", "cls.", "embeddings.position_ids")


@dataclass(frozen=True)
class BertConfig:
    """The subset of a Hugging Face BERT config.json that shapes the encoder.

    Invariant: hidden_size is divisible by num_attention_heads, hidden_act is a GELU form.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not one of {list(_ACTIVATIONS)}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BertConfig:
        archs = d.get("architectures") or ["BertModel"]
        if not any(a in _ARCHITECTURES for a in archs):
            raise ValueError(f"architectures {archs} has none of {_ARCHITECTURES}")
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("position_embedding_type must be 'absolute'")
        try:
            return cls(
                vocab_size=int(d["vocab_size"]),
                hidden_size=int(d["hidden_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=int(d["num_attention_heads"]),
                intermediate_size=int(d["intermediate_size"]),
                max_position_embeddings=int(d["max_position_embeddings"]),
                type_vocab_size=int(d.get("type_vocab_size", 2)),
                layer_norm_eps=float(d.get("layer_norm_eps", 1e-12)),
                hidden_act=str(d.get("hidden_act", "gelu")),
            )
        except KeyError as e:
            raise ValueError(f"config.json is missing field {e.args[0]!r}") from None

    @classmethod
    def from_folder(cls, folder: Path) -> BertConfig:
        return cls.from_dict(json.loads((Path(folder) / "config.json").read_text()))


@dataclass(frozen=True)
class _PaddedLayout:
    """Where each flattened token sits in a padded [B, L] batch, built once per forward."""

    flat_to_padded: Tensor  # [T] index into B * L rows
    key_mask: Tensor | None  # [B, 1, 1, L] True = attend; None when there is no padding
    batch: int
    max_len: int

    @classmethod
    def build(
        cls, query_start_loc: list[int], num_tokens: int, device: torch.device
    ) -> _PaddedLayout:
        if len(query_start_loc) < 2 or query_start_loc[0] != 0:
            raise ValueError("query_start_loc must start at 0 and name at least one sequence")
        if query_start_loc[-1] != num_tokens:
            raise ValueError(
                f"query_start_loc ends at {query_start_loc[-1]} "
                f"but input_ids has {num_tokens} tokens"
            )
        lens = [b - a for a, b in zip(query_start_loc[:-1], query_start_loc[1:])]
        if min(lens) < 1:
            raise ValueError("query_start_loc must be strictly increasing (no empty sequences)")
        batch, max_len = len(lens), max(lens)
        # Built on the CPU from Python ints, then moved: no device sync inside the forward.
        lens_t = torch.tensor(lens)
        starts = torch.tensor(query_start_loc[:-1])
        row_base = torch.arange(batch) * max_len - starts
        flat_to_padded = torch.arange(num_tokens) + torch.repeat_interleave(row_base, lens_t)
        key_mask = None
        if min(lens) != max_len:
            key_mask = (torch.arange(max_len)[None, :] < lens_t[:, None])[:, None, None, :]
            key_mask = key_mask.to(device, non_blocking=True)
        return cls(flat_to_padded.to(device, non_blocking=True), key_mask, batch, max_len)


class BertLayer(nn.Module):
    """One post-LayerNorm transformer block with a fused q/k/v projection."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = h // cfg.num_attention_heads
        self.qkv = nn.Linear(h, 3 * h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.ffn_up = nn.Linear(h, cfg.intermediate_size)
        self.ffn_down = nn.Linear(cfg.intermediate_size, h)
        self.ffn_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.gelu_approx = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: Tensor, layout: _PaddedLayout) -> Tensor:
        x = self.attn_norm(x + self.attn_out(self._attention(x, layout)))
        ffn = self.ffn_down(F.gelu(self.ffn_up(x), approximate=self.gelu_approx))
        return self.ffn_norm(x + ffn)

    def _attention(self, x: Tensor, layout: _PaddedLayout) -> Tensor:
        t, h = x.shape
        qkv = self.qkv(x)
        # Scatter into a zero-padded [B, L] grid so one SDPA call covers every sequence;
        # the key mask keeps each query inside its own sequence.
        padded = qkv.new_zeros(layout.batch * layout.max_len, 3 * h)
        padded[layout.flat_to_padded] = qkv
        q, k, v = (
            padded.view(layout.batch, layout.max_len, 3, self.num_heads, self.head_dim)
            .permute(2, 0, 3, 1, 4)
            .unbind(0)
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=layout.key_mask)
        out = out.transpose(1, 2).reshape(layout.batch * layout.max_len, h)
        return out[layout.flat_to_padded]


class BertModel(nn.Module):
    """BERT encoder returning the last hidden state of a flattened batch of sequences.

    Invariants: token_type_ids are all 0 (single-segment inputs); each sequence in a forward
    is complete, and tokens attend only to tokens of their own sequence.
    """

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, input_ids: Tensor, positions: Tensor, query_start_loc: list[int]) -> Tensor:
        """input_ids, positions: [T]; sequence b owns rows query_start_loc[b]:[b + 1]. -> [T, H]."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError("input_ids and positions must be 1-D tensors of the same length")
        layout = _PaddedLayout.build(query_start_loc, input_ids.shape[0], input_ids.device)
        if layout.max_len > self.cfg.max_position_embeddings:
            raise ValueError(
                f"a sequence of {layout.max_len} tokens exceeds "
                f"max_position_embeddings {self.cfg.max_position_embeddings}"
            )
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings.weight[0]
        )
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, layout)
        return x

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy Hugging Face BERT tensors in; names may carry a `bert.` prefix (BertForMaskedLM).

        Raises ValueError naming an unexpected tensor, or the parameters never loaded.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = _normalise_hf_name(hf_name)
            if name.startswith(_IGNORED_PREFIXES):
                continue
            target, rows = _map_name(name)
            if target not in params:
                raise ValueError(f"unexpected weight {hf_name!r}")
            param = params[target]
            dst = param.data if rows is None else param.data.chunk(3, dim=0)[rows]
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"weight {hf_name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(dst.shape)}"
                )
            with torch.no_grad():
                dst.copy_(tensor)
            loaded.add(target if rows is None else f"{target}#{rows}")
        expected = {n for n in params if ".qkv." not in n}
        expected |= {f"{n}#{i}" for n in params if ".qkv." in n for i in range(3)}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"weights missing from the checkpoint: {missing}")


def _normalise_hf_name(name: str) -> str:
    name = name.removeprefix("bert.")
    # Very old TF-converted checkpoints name LayerNorm parameters gamma/beta.
    if name.endswith(".gamma"):
        name = name[: -len("gamma")] + "weight"
    elif name.endswith(".beta"):
        name = name[: -len("beta")] + "bias"
    return name


_EMBED_NAMES = {
    "embeddings.word_embeddings": "word_embeddings",
    "embeddings.position_embeddings": "position_embeddings",
    "embeddings.token_type_embeddings": "token_type_embeddings",
    "embeddings.LayerNorm": "embed_norm",
}
_LAYER_NAMES = {
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "ffn_up",
    "output.dense": "ffn_down",
    "output.LayerNorm": "ffn_norm",
}
_QKV_ROWS = {"attention.self.query": 0, "attention.self.key": 1, "attention.self.value": 2}


def _map_name(name: str) -> tuple[str, int | None]:
    """HF name (no `bert.` prefix) -> (our parameter name, q/k/v slice of the fused qkv or None)."""
    module, _, leaf = name.rpartition(".")
    if module in _EMBED_NAMES:
        return f"{_EMBED_NAMES[module]}.{leaf}", None
    parts = module.split(".", 3)
    if len(parts) == 4 and parts[0] == "encoder" and parts[1] == "layer":
        prefix, rest = f"layers.{parts[2]}", parts[3]
        if rest in _QKV_ROWS:
            return f"{prefix}.qkv.{leaf}", _QKV_ROWS[rest]
        if rest in _LAYER_NAMES:
            return f"{prefix}.{_LAYER_NAMES[rest]}.{leaf}", None
    return name, None


def load_bert(folder: Path, dtype: torch.dtype, device: torch.device | str) -> BertModel:
    """Build a BertModel from a Hugging Face folder (config.json + *.safetensors), eval mode."""
    folder = Path(folder)
    cfg = BertConfig.from_folder(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights in {folder}")
    with torch.device("meta"):
        model = BertModel(cfg)
    model = model.to_empty(device=device).to(dtype)
    model.load_weights(_iter_safetensors(files))
    logger.info(
        "loaded BERT from %s: %d layers, hidden %d", folder, cfg.num_hidden_layers, cfg.hidden_size
    )
    return model.eval()


def _iter_safetensors(files: list[Path]) -> Iterable[tuple[str, Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)

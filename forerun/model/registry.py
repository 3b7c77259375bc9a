"""Pick and load the model class named by a Hugging Face folder's config.json."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterable, Protocol

import torch
from torch import Tensor

from forerun.kernels.compact_weights import CompactWeight
from forerun.heap import return_free_heap, trim_heap
from forerun.loader.weights import is_gguf_folder, iter_model_weights
from forerun.model.attention import AttentionBackend, AttentionMetadata
from forerun.model.dummy import init_dummy_weights
from forerun.model.layers import place_blocks_on_huge_pages
from forerun.model.llama import (LlamaArgs, LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
                                 Qwen3ForCausalLM, matmul_shapes)
from forerun.model.parallel import PPStage, TPGroup

logger = logging.getLogger(__name__)

_ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


class CausalLM(Protocol):
    """What every generative model offers the worker. `num_kv_heads` is per tensor-parallel rank."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]: ...

    def limit_positions(self, max_model_len: int) -> None: ...

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[Tensor],
                attn: AttentionMetadata) -> Tensor: ...

    def compute_logits(self, hidden: Tensor, float32: bool = True) -> Tensor: ...

    def greedy_ids(self, logits: Tensor) -> Tensor | None: ...

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None: ...


def resolve_architecture(config: dict) -> tuple[str, type[LlamaForCausalLM]]:
    """The first supported name in config['architectures'] and its class."""
    names = config.get("architectures") or []
    for name in names:
        if name in _ARCHITECTURES:
            return name, _ARCHITECTURES[name]
    raise ValueError(f"architectures: {names!r} has no supported model (supported: {sorted(_ARCHITECTURES)})")


def model_matmul_shapes(config: dict, tp_size: int = 1, logits: bool = True) -> list[tuple[int, int, int]]:
    """(in, out, count) of the matmuls one token passes through, per rank, from config.json alone
    (without the vocabulary projection unless `logits`)."""
    arch, _ = resolve_architecture(config)
    return matmul_shapes(LlamaArgs.from_config(config, arch), tp_size, logits)


def check_pipeline_stages(folder: Path, pp_size: int) -> None:
    """Raise ValueError naming `pipeline_parallel_size` when the model has fewer layers than stages;
    read from config.json alone, so it can be checked before any worker starts."""
    config = json.loads((Path(folder) / "config.json").read_text())
    PPStage.split(0, pp_size, int(config["num_hidden_layers"]))


def load_model(folder: Path, dtype: torch.dtype, device: torch.device, tp: TPGroup = TPGroup(),
               backend: AttentionBackend | None = None, pp_rank: int = 0, pp_size: int = 1,
               keep_blocks: bool = True, load_format: str = "auto") -> CausalLM:
    """Build the model for `folder`'s config.json on `device` in `dtype` and load its weights
    (attention through `backend`, stock PyTorch when None); with `pp_size` > 1 only pipeline stage
    `pp_rank`'s share of the layers. A GGUF file's quantized matrices stay blocks when `keep_blocks`
    (their matmuls then need `use_linear_kernel`), else they are expanded to dense weights in `dtype`.
    `load_format` "dummy": random dense weights, the checkpoint unread."""
    config_path = Path(folder) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"folder: no config.json in {folder}")
    config = json.loads(config_path.read_text())
    arch, cls = resolve_architecture(config)
    args = LlamaArgs.from_config(config, arch)
    pp = PPStage.split(pp_rank, pp_size, args.num_layers) if pp_size > 1 else PPStage()
    with torch.device(device):
        model = cls(args, tp, backend, pp)
    if load_format == "dummy":
        model.to(dtype)
        init_dummy_weights(model)
    elif is_gguf_folder(Path(folder)):
        weights = iter_model_weights(Path(folder))
        if not keep_blocks:
            weights = ((n, w.expand() if isinstance(w, CompactWeight) else w) for n, w in weights)
        # Loaded first, converted after: the matrices that stay blocks then never take dense memory.
        model.load_weights(weights)
        model.to(dtype)
        if device.type == "cpu" and place_blocks_on_huge_pages(model, release=trim_heap):
            return_free_heap()  # the blocks' first copies
    else:
        model.to(dtype)
        model.load_weights(iter_model_weights(Path(folder)))
    model.requires_grad_(False).eval()
    if model.holds_blocks():
        logger.info("the GGUF file's quantized matrices are held as stored (%s mostly)", model.compact_format())
    logger.info("loaded %s from %s (%d layers, tp rank %d/%d)", arch, folder, args.num_layers, tp.rank, tp.size)
    return model

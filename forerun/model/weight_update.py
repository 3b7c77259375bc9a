"""Updating a loaded model's weights in place from (Hugging Face name, tensor) pairs, as RL trainers
push a new policy between rollouts.

Each rank cuts its own tensor-parallel shard (the layers' `load_weight`) and skips what another
pipeline stage holds; q/k/v and gate/up land in their packed matrices; afterwards the kernels' copies
of every changed weight (packed GEMM panels, compact GEMV weights, the one-call decode step) are built
again from the new values. A push may be partial and may come one tensor a call (OpenRLHF does).

Where a packed kernel replaced a layer's dense weight (`PackableLinear.dense_shape` set), the dense
weight is brought back for the update; a packed layer is rebuilt once all its parts (q, k and v) have
arrived, possibly over several calls, and until then keeps serving its previous weights.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any, Iterable, Iterator, Protocol

import torch
from torch import Tensor, nn

from forerun.kernels.linear import LinearPlan
from forerun.model.layers import (ColumnParallelLinear, MergedColumnParallelLinear, PackableLinear,
                                  RowParallelLinear, VocabParallelEmbedding)

logger = logging.getLogger(__name__)


class UpdatableModel(Protocol):
    """What an update needs of a model (forerun.model.llama.LlamaForCausalLM has it)."""

    args: Any  # .tie_word_embeddings
    model: nn.Module  # .embed_tokens
    lm_head: Any
    num_layers: int
    local_layers: range
    packed_modules_mapping: dict[str, tuple[str, int]]
    pending_parts: dict[str, set[int]]
    linear_plan: LinearPlan | None
    decode_kernels: tuple[ctypes.CDLL, bool] | None

    def get_submodule(self, target: str) -> nn.Module: ...
    def named_modules(self) -> Iterator[tuple[str, nn.Module]]: ...
    def holds_blocks(self) -> bool: ...
    def compact_format(self) -> str | None: ...
    def _on_this_stage(self, name: str) -> bool: ...
    def use_kernel_for(self, module: PackableLinear, plan: LinearPlan) -> bool: ...
    def use_decode_layers(self, lib: ctypes.CDLL, split: bool = True) -> str | None: ...


def update_in_place(model: UpdatableModel, weights: Iterable[tuple[str, Any]]) -> list[str]:
    """Copy `weights` into the loaded `model` and rebuild what its kernels derived from them; returns
    the names applied on this rank. ValueError naming the tensor for an unknown name or a wrong shape
    (tensors before it stay applied, and their kernels' copies are rebuilt all the same)."""
    _refuse_blocks(model)
    applied: list[str] = []
    touched: dict[int, nn.Module] = {}
    try:
        with torch.no_grad():
            for item in weights:
                name, tensor = _pair(item)
                target = checkpoint_target(model, name)
                if target is None:
                    continue
                module_path, param, part = target
                module = model.get_submodule(module_path)
                _check_shape(name, tensor, _full_shape(module, param, part))
                _copy(model, module, module_path, param, part, tensor)
                touched[id(module)] = module
                applied.append(name)
    finally:
        if touched:
            _rebuild(model, list(touched.values()))
    return applied


def checkpoint_target(model: UpdatableModel, name: str) -> tuple[str, str, int | None] | None:
    """Where checkpoint tensor `name` goes on this rank: (module path, parameter, packed part or None);
    None for one this rank does not hold (rotary tables, a tied LM head, another pipeline stage's
    layers); ValueError for a name the model has no parameter for."""
    if not isinstance(name, str):
        raise ValueError(f"load_weights: a parameter name must be a string, got {type(name).__name__}")
    if "rotary_emb." in name or (name == "lm_head.weight" and model.args.tie_word_embeddings):
        return None
    module_path, _, param = name.rpartition(".")
    parent, _, leaf = module_path.rpartition(".")
    part = None
    if leaf in model.packed_modules_mapping:
        leaf, part = model.packed_modules_mapping[leaf]
        module_path = f"{parent}.{leaf}"
    if not _known(model, module_path, param, name):
        raise ValueError(f"load_weights: unknown parameter {name!r} for {type(model).__name__}")
    return (module_path, param, part) if model._on_this_stage(name) else None


def _known(model: UpdatableModel, module_path: str, param: str, name: str) -> bool:
    """Whether the model has `param` under `module_path`. A layer another pipeline stage holds is judged
    by the first local layer, which has the same parameters."""
    parts = module_path.split(".")
    if parts[:2] == ["model", "layers"]:
        if len(parts) < 3 or not parts[2].isdigit() or int(parts[2]) >= model.num_layers:
            return False
        parts[2] = str(model.local_layers[0])
    elif not model._on_this_stage(name):
        return parts[0] in ("model", "lm_head")  # the embedding, final norm or head of another stage
    try:
        module = model.get_submodule(".".join(parts))
    except AttributeError:
        return False
    return param in ("weight", "bias") and isinstance(getattr(module, param, None), Tensor)


def _pair(item: Any) -> tuple[str, Tensor]:
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise ValueError("load_weights: expected an iterable of (name, tensor) pairs")
    name, tensor = item
    if not isinstance(tensor, Tensor):
        raise ValueError(f"load_weights: {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    return name, tensor


def _refuse_blocks(model: UpdatableModel) -> None:
    """A GGUF file's quantized blocks are not re-quantized from a trainer's dense tensors: refuse."""
    embed = model.model.embed_tokens
    if model.holds_blocks() or (embed is not None and embed.table is not None):
        raise ValueError(f"load_weights: this engine holds a GGUF file's quantized weights "
                         f"({model.compact_format()}), which are not updated in place; start it from a Hugging "
                         "Face safetensors folder (load_format='dummy' skips reading its weights)")


def _full_shape(module: nn.Module, param: str, part: int | None) -> tuple[int, ...]:
    """The unsharded shape a checkpoint holds for `param` (of packed part `part`) of `module`."""
    tp_size = module.tp.size if hasattr(module, "tp") else 1
    weight = getattr(module, "weight", None)
    dense = tuple(weight.shape) if weight is not None and weight.numel() else getattr(module, "dense_shape", None)
    if isinstance(module, VocabParallelEmbedding):  # the LM head too: both split the vocabulary
        return (module.vocab_size, dense[1]) if param == "weight" else (module.vocab_size,)
    if isinstance(module, MergedColumnParallelLinear):
        assert part is not None
        rows = module.sizes[part] * tp_size
        return (rows, dense[1]) if param == "weight" else (rows,)
    if isinstance(module, ColumnParallelLinear):
        rows = module.out_per_rank * tp_size
        return (rows, dense[1]) if param == "weight" else (rows,)
    if isinstance(module, RowParallelLinear):
        return (dense[0], module.in_per_rank * tp_size) if param == "weight" else (dense[0],)
    return tuple(getattr(module, param).shape)


def _check_shape(name: str, tensor: Tensor, want: tuple[int, ...]) -> None:
    # copy_ would broadcast a smaller tensor silently, so shapes must match exactly.
    if tuple(tensor.shape) != want:
        raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, expected {want}")


def _copy(model: UpdatableModel, module: nn.Module, path: str, param: str, part: int | None,
          tensor: Tensor) -> None:
    if isinstance(module, PackableLinear) and param == "weight" and not module.weight.numel():
        # Only the packed copy is left: a dense weight again, filled part by part.
        module.weight = nn.Parameter(torch.zeros(module.dense_shape, dtype=module.weight.dtype,
                                                 device=module.weight.device), requires_grad=False)
        model.pending_parts[path] = set()
    if part is not None:
        module.load_weight(param, tensor, part)
    elif hasattr(module, "load_weight"):
        module.load_weight(param, tensor)
    else:
        getattr(module, param).data.copy_(tensor)
    if param == "weight" and path in model.pending_parts:
        model.pending_parts[path].add(part or 0)


def _rebuild(model: UpdatableModel, touched: list[nn.Module]) -> None:
    """Rebuild the kernels' copies of every changed matmul whose weight is whole again."""
    tied = model.args.tie_word_embeddings and model.lm_head is not None
    if tied and any(m is model.model.embed_tokens for m in touched):
        touched.append(model.lm_head)  # the LM head multiplies by the embedding's (changed) table
    ready = []
    paths = {id(m): p for p, m in model.named_modules()}
    for module in touched:
        if not isinstance(module, PackableLinear):
            continue
        path = paths[id(module)]
        if path in model.pending_parts:
            parts = len(module.sizes) if isinstance(module, MergedColumnParallelLinear) else 1
            if len(model.pending_parts[path]) < parts:
                logger.debug("%s: waiting for the rest of its parts before rebuilding its packed copy", path)
                continue
            del model.pending_parts[path]
        if not module.weight.numel():  # a bias alone, for a layer whose weight lives only packed
            logger.warning("%s: its bias changed but its weight did not; push both for the packed copy to "
                           "change", path)
            continue
        ready.append(module)
    if model.linear_plan is not None:  # what use_linear_kernel built, built again from the new values
        for module in ready:
            model.use_kernel_for(module, model.linear_plan)
    if model.decode_kernels is not None:  # the one-call step holds the layers' compact weights and norms
        model.use_decode_layers(*model.decode_kernels)

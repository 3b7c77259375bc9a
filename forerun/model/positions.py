"""What a model's config.json says of its positions, read before any weight is loaded: the rope scaling it
names and how many positions it admits."""

from __future__ import annotations

from typing import Any


def config_rope_scaling(hf_config: dict[str, Any]) -> dict[str, Any] | None:
    """The config's rope scaling: `rope_scaling`, or transformers >= 5's `rope_parameters` where it names
    a rope type other than the default; None for plain rotary."""
    rope = hf_config.get("rope_parameters") or {}
    return hf_config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)


def model_positions(hf_config: dict[str, Any]) -> int | None:
    """The longest sequence a model's config.json admits: `max_position_embeddings`, or with YaRN rotary
    scaling its original context times the factor where that is longer. YaRN exists to stretch the
    context the model was trained on by its factor, and the configs that turn it on (Qwen2.5 and Qwen3,
    and GGUF files converted from them) keep max_position_embeddings at the original context; vLLM
    derives its max_model_len the same way. None when the config gives no positive limit."""
    limit = hf_config.get("max_position_embeddings")
    limit = limit if isinstance(limit, int) and limit > 0 else None
    scaling = config_rope_scaling(hf_config)
    if isinstance(scaling, dict) and (scaling.get("rope_type") or scaling.get("type")) == "yarn":
        original, factor = scaling.get("original_max_position_embeddings") or limit, scaling.get("factor")
        if isinstance(original, int) and isinstance(factor, (int, float)) and factor > 1:
            limit = max(limit or 0, int(original * factor))
    return limit

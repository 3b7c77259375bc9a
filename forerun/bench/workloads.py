"""Benchmark workloads: random prompts of given lengths, and a tiny random Llama for overhead-bound runs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from forerun.sampling_params import SamplingParams


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    params: list[SamplingParams]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def random_workload(vocab_size: int, num_prompts: int, input_len: int, output_len: int, vary: bool,
                    ignore_eos: bool, seed: int = 0, low_token: int = 100) -> Workload:
    """Random token prompts; with `vary`, lengths are uniform in [len/2, 3*len/2] (as vLLM's random set)."""
    rng = np.random.default_rng(seed)

    def length(n: int) -> int:
        return int(rng.integers(max(1, n // 2), n + n // 2 + 1)) if vary else n

    prompts = [rng.integers(low_token, vocab_size, size=length(input_len)).tolist() for _ in range(num_prompts)]
    params = [SamplingParams(temperature=0.0, max_tokens=length(output_len), ignore_eos=ignore_eos)
              for _ in range(num_prompts)]
    return Workload(prompts, params)


PERSON_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[A-Za-z ]{1,24}$"}, "age": {"type": "integer"},
    "city": {"type": "string", "pattern": "^[A-Za-z ]{1,24}$"}, "member": {"type": "boolean"}},
    "required": ["name", "age", "city", "member"], "additionalProperties": False}


def with_structured_ratio(workload: Workload, ratio: float, seed: int = 0) -> Workload:
    """Give a `ratio` share of the requests a JSON schema with a few typed fields (they stop when it closes)."""
    from forerun.structured.spec import StructuredOutputsParams
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"structured_output_ratio: must be in [0, 1], got {ratio}")
    rng = np.random.default_rng(seed)
    chosen = set(rng.permutation(len(workload.prompts))[:round(ratio * len(workload.prompts))].tolist())
    spec = StructuredOutputsParams(json=PERSON_SCHEMA)
    params = [SamplingParams(temperature=0.0, max_tokens=p.max_tokens, structured_outputs=spec) if i in chosen else p
              for i, p in enumerate(workload.params)]
    return Workload(workload.prompts, params)


def make_tiny_llama(out: Path, tokenizer_folder: Path, hidden: int = 256, layers: int = 4, seed: int = 0,
                    vocab: int | None = None) -> Path:
    """A random Llama (forerun's own safetensors writer, no transformers needed) with the given tokenizer.

    `vocab` may be smaller than the tokenizer's: ids below it still detokenize, and a small LM head keeps the
    model's share of a step small (an overhead-bound workload)."""
    import shutil

    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    vocab = vocab or json.loads((tokenizer_folder / "config.json").read_text())["vocab_size"]
    heads, kv_heads, inter = max(1, hidden // 64), max(1, hidden // 128), hidden * 3
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "max_position_embeddings": 2048, "vocab_size": vocab,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
           "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(seed)
    d = hidden // heads

    def w(*shape: int) -> torch.Tensor:
        # numpy, not torch: the benchmark's main thread must not start an OpenMP pool of its own.
        return torch.from_numpy((rng.standard_normal(shape) * 0.05).astype(np.float32))

    ones = lambda n: torch.from_numpy(np.ones(n, np.float32))  # noqa: E731
    tensors = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": w(heads * d, hidden), p + "self_attn.k_proj.weight": w(kv_heads * d, hidden),
                    p + "self_attn.v_proj.weight": w(kv_heads * d, hidden), p + "self_attn.o_proj.weight": w(hidden, heads * d),
                    p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
                    p + "mlp.down_proj.weight": w(hidden, inter), p + "input_layernorm.weight": ones(hidden),
                    p + "post_attention_layernorm.weight": ones(hidden)}
    save_file(tensors, str(out / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        if (tokenizer_folder / name).exists():
            shutil.copy(tokenizer_folder / name, out / name)
    return out

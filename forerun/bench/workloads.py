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


# Original passages for the input-grounded workload (each over 200 tokens with the default tokenizer).
_PASSAGES = (
    "The old lighthouse stood at the end of a narrow spit of rock, and for ninety years its keepers had "
    "climbed the same one hundred and twelve steps every evening to light the lamp. The last keeper, a "
    "quiet man named Tobias Fenn, kept a logbook in which he wrote down the weather, the ships that "
    "passed, and the birds that rested on the gallery rail. When the light was automated in the spring "
    "of 1987, he was asked to leave the tower, but he refused to go far. He bought a small cottage on "
    "the hill above the harbour, and from its kitchen window he could still see the beam turning over "
    "the water. Every evening at dusk he would stand by that window with a cup of tea and watch the "
    "first flash cross the bay, and every morning he would write a single line in a new logbook: the "
    "light worked, the sea was calm or rough, and the gulls were loud. He kept this second logbook for "
    "twenty-two years, until the day the harbour master found him asleep in his chair by the window, "
    "the pen still in his hand and the beam still turning over the dark water below.",
    "To make a simple loaf of bread, start by mixing five hundred grams of strong white flour with ten "
    "grams of salt and seven grams of dried yeast in a large bowl. Add three hundred and fifty millilitres "
    "of lukewarm water and two tablespoons of olive oil, then stir with a wooden spoon until a rough dough "
    "forms. Turn the dough out onto a lightly floured surface and knead it for ten minutes, pushing it away "
    "with the heel of your hand and folding it back, until it becomes smooth and elastic. Place the dough "
    "in a clean bowl, cover it with a damp towel, and leave it somewhere warm for about an hour, or until "
    "it has doubled in size. Knock the air out of the dough, shape it into a tight round, and put it on a "
    "baking tray dusted with flour. Leave it to rise for another forty minutes while the oven heats to two "
    "hundred and twenty degrees. Slash the top with a sharp knife, bake for thirty minutes until the crust "
    "is deep golden brown, and let the loaf cool on a wire rack before you slice it.",
    "Dear Ms. Alvarez, thank you for your letter of the fourteenth of March regarding the delayed delivery "
    "of your order. I am sorry that the three boxes of ceramic tiles did not arrive on the date we promised, "
    "and I understand how frustrating it must have been to reschedule the builders at such short notice. "
    "Our warehouse in Leeds had a problem with its loading system during the second week of March, and a "
    "number of orders, including yours, were held back for five working days. The tiles were dispatched "
    "on the twentieth of March and our records show that they were delivered to your address on the "
    "twenty-second. As an apology for the inconvenience, we have refunded the delivery charge of "
    "twenty-five pounds to your card, and we would like to offer you a discount of fifteen percent on "
    "your next order with us. If any of the tiles arrived damaged, please send us a photograph and we "
    "will replace them free of charge. Thank you again for your patience. Yours sincerely, Daniel Price, "
    "Customer Service Manager.",
    "The river begins as a thin stream high in the mountains, where snow melts slowly through the spring "
    "and summer. It runs quickly over smooth grey stones, past pine trees and small meadows full of "
    "yellow flowers, and by the time it reaches the first village it is wide enough for children to "
    "swim in during the warm afternoons. Below the village the valley opens out, and the river slows "
    "down as it winds between fields of wheat and barley. Farmers have drawn water from it for centuries, "
    "and the remains of old stone mills can still be seen along its banks. Further south it passes through "
    "a market town with a bridge of seven arches, built in the fourteenth century and still used by cars "
    "and lorries today. After the town the river grows broad and brown, carrying mud and leaves towards "
    "the coast, until at last it spreads into a wide estuary of sandbanks and reeds, where thousands of "
    "wading birds gather every winter to feed on the mudflats at low tide.",
)
_TASKS = (
    "Repeat the following passage exactly, word for word, with no comments:\n\n{p}",
    "Copy the passage below, but replace every number written in words with digits. Change nothing else:\n\n{p}",
    "Rewrite the following passage in the present tense where it is in the past tense, keeping every other "
    "word the same:\n\n{p}",
    "Correct any spelling mistakes in the passage below and output the full corrected passage:\n\n{p}",
)


def grounded_workload(tokenizer, num_prompts: int, output_len: int) -> Workload:
    """Chat prompts asking the model to repeat or lightly edit a passage of 200+ tokens: outputs that
    copy their input, where prompt-lookup drafting pays. Greedy; requests may stop at EOS."""
    prompts = []
    for i in range(num_prompts):
        text = _TASKS[(i // len(_PASSAGES)) % len(_TASKS)].format(p=_PASSAGES[i % len(_PASSAGES)])
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append(tokenizer.encode(chat, add_special_tokens=False))
    params = [SamplingParams(temperature=0.0, max_tokens=output_len) for _ in range(num_prompts)]
    return Workload(prompts, params)

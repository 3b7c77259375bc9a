"""Greedy reference outputs from Hugging Face transformers (test-time only)."""

from __future__ import annotations

from pathlib import Path

import torch


def hf_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Token-by-token greedy decoding with the KV cache, never stopping early (EOS is just a token)."""
    import transformers as tf
    model = tf.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            res = model(x, use_cache=True)
            past, got = res.past_key_values, []
            for _ in range(max_new_tokens):
                tok = int(res.logits[0, -1].argmax())
                got.append(tok)
                res = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
                past = res.past_key_values
            outs.append(got)
    return outs


def hf_prompt_logprobs(folder: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt, [P - 1, V] float32 log_softmax of the logits at positions 0 .. P - 2: row j is the
    distribution that prompt token j + 1 was drawn from."""
    import transformers as tf
    model = tf.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.inference_mode():
        return [torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1) for ids in prompts]

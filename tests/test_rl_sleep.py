"""Sleep mode: sleep(1) returns the KV cache's resident memory to the OS, sleep(2) the weights' too
(measured as this process's RSS, the uni worker living in it); generation is refused while asleep;
after wake_up (and, at level 2, load_weights) the tokens are those of before."""

from __future__ import annotations

import gc
from pathlib import Path

import psutil
import pytest
import torch

from conftest import save_tiny_model
from forerun import LLM, SamplingParams
from rl_helpers import read_weights

PROMPTS = [{"prompt_token_ids": [1, 504, 3458, 314, 1345]}, "The capital of France is"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10)


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory, smollm2_dir) -> Path:
    """Weights of about 60 MiB (the embedding mostly), so that freeing them shows in the RSS."""
    return save_tiny_model(tmp_path_factory.mktemp("wide"), smollm2_dir, hidden_size=256, intermediate_size=512,
                           num_attention_heads=4, num_key_value_heads=2)


def rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def kv_bytes(llm: LLM) -> int:
    return llm.collective_rpc(lambda w: sum(c.numel() * c.element_size() for c in w.runner.kv_caches))[0]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_returns_memory_and_wake_up_restores_the_engine(level, wide_dir, track_llm):
    llm = track_llm(LLM(model=str(wide_dir), dtype="float32", enable_sleep_mode=True, kv_cache_memory="96MiB",
                        show_progress=False))
    before = tokens(llm)
    llm.collective_rpc("touch_kv_cache")  # a cache that has served a while is resident
    weights = read_weights(wide_dir)
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    expected = kv_bytes(llm) + (weight_bytes if level == 2 else 0)
    awake = rss()
    llm.sleep(level)
    drop = awake - rss()
    assert drop >= 0.8 * expected, f"sleep({level}) freed {drop >> 20} MiB of {expected >> 20} MiB"
    with pytest.raises(ValueError, match="asleep"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    with pytest.raises(ValueError, match="already asleep"):
        llm.sleep(1)
    with pytest.raises(ValueError, match="unknown tag 'gpu'"):
        llm.wake_up(["gpu"])
    if level == 2:
        with pytest.raises(ValueError, match="weights are asleep"):
            llm.load_weights(weights.items())
    llm.wake_up(tags=["weights"])
    if level == 2:
        llm.load_weights(weights.items())
    with pytest.raises(ValueError, match="asleep"):  # the KV cache still sleeps
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    llm.wake_up(tags=["kv_cache"])
    assert tokens(llm) == before
    with pytest.raises(ValueError, match="not asleep"):
        llm.wake_up()


def test_level_2_is_refused_for_gguf_blocks_and_level_1_works(track_llm):
    llm = track_llm(LLM(show_progress=False, num_kv_blocks=64, max_model_len=512, enable_sleep_mode=True))
    before = tokens(llm)
    with pytest.raises(ValueError, match="GGUF"):
        llm.sleep(2)
    with pytest.raises(ValueError, match="GGUF file's quantized weights"):
        llm.load_weights([("model.norm.weight", torch.ones(576))])
    llm.sleep(1)
    llm.wake_up()
    assert tokens(llm) == before

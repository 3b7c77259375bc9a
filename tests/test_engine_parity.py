"""Greedy token parity with transformers, over mixed batches, and across engine settings."""

from __future__ import annotations

import threading

import pytest

from forerun import LLM, SamplingParams
from tests.conftest import save_tiny_model
from tests.hf_reference import hf_greedy

PROMPTS = ["The capital of France is", "Write a haiku about the sea.\nIt goes like this:",
           "1, 2, 3, 4,", "Once upon a time, in a land far away, there lived a dragon who loved to read books about"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def run(folder, prompts, params=GREEDY, **kw):
    kw.setdefault("show_progress", False)
    kw.setdefault("dtype", "float32")  # transformers runs fp32; `auto` may measure bf16 faster on a CPU
    with LLM(model=str(folder), **kw) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = (llm.engine.core.scheduler.num_preemptions, llm.engine.core.scheduler.kv.num_free_blocks,
                 llm.engine.core.num_blocks)
    return outs, stats


def token_prompts(folder, prompts):
    from forerun.engine.tokenizer import Tokenizer
    tok = Tokenizer.from_folder(folder)
    return [tok.encode(p) for p in prompts]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_tiny_models_match_transformers(tmp_path, smollm2_dir, arch):
    extra = {"attention_bias": True} if arch == "qwen2" else {}
    folder = save_tiny_model(tmp_path / arch, smollm2_dir, arch=arch, seed=1, **extra)
    ids = token_prompts(folder, PROMPTS)
    want = hf_greedy(folder, ids, 32)
    for async_mode in (False, True):
        outs, _ = run(folder, ids, async_scheduling=async_mode)
        assert [o.outputs[0].token_ids for o in outs] == want, f"{arch} async={async_mode}"


def test_smollm2_matches_transformers(smollm2_dir, smollm2_hf_dir):
    ids = token_prompts(smollm2_dir, PROMPTS)
    want = hf_greedy(smollm2_hf_dir, ids, 32)
    outs, _ = run(smollm2_dir, ids)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert outs[0].outputs[0].text.startswith(" Paris")


@pytest.mark.parametrize("async_mode", [False, True])
def test_settings_do_not_change_tokens(tiny_llama_dir, async_mode):
    ids = token_prompts(tiny_llama_dir, PROMPTS) + token_prompts(tiny_llama_dir, PROMPTS[:2])  # repeats
    base, _ = run(tiny_llama_dir, ids, async_scheduling=async_mode)
    want = [o.outputs[0].token_ids for o in base]
    variants = {
        "chunked": dict(max_num_batched_tokens=8),
        "no-prefix-cache": dict(enable_prefix_caching=False),
        # max_model_len unset: it comes from the model (1024), and one step's budget must hold it.
        "no-chunking": dict(enable_chunked_prefill=False, max_num_batched_tokens=1024),
        "block-4": dict(block_size=4),
    }
    for name, kw in variants.items():
        outs, (_, free, total) = run(tiny_llama_dir, ids, async_scheduling=async_mode, **kw)
        assert [o.outputs[0].token_ids for o in outs] == want, name
        assert free == total, f"{name}: blocks leaked"


@pytest.mark.parametrize("async_mode", [False, True])
def test_a_prompt_cached_whole_computes_only_its_last_token(tiny_llama_dir, async_mode):
    """A prompt whose blocks are all cached (its length a multiple of the block size) reuses every token
    but the last, its last block's KV copied by the worker: the tokens stay those without the cache."""
    ids = [list(range(100, 164)), list(range(100, 132)) + list(range(300, 332))]  # 4 blocks of 16 each
    with LLM(model=str(tiny_llama_dir), dtype="float32", async_scheduling=async_mode, show_progress=False) as llm:
        first = llm.generate(ids, GREEDY, use_tqdm=False)
        again = llm.generate(ids, GREEDY, use_tqdm=False)
        assert llm.engine.core.scheduler.kv.num_free_blocks == llm.engine.core.num_blocks
    off, _ = run(tiny_llama_dir, ids, async_scheduling=async_mode, enable_prefix_caching=False)
    assert [o.num_cached_tokens for o in again] == [63, 63]
    want = [o.outputs[0].token_ids for o in off]
    assert [o.outputs[0].token_ids for o in first] == want and [o.outputs[0].token_ids for o in again] == want


@pytest.mark.parametrize("async_mode", [False, True])
def test_preemption_keeps_tokens(tiny_llama_dir, async_mode):
    ids = token_prompts(tiny_llama_dir, PROMPTS)
    base, _ = run(tiny_llama_dir, ids, async_scheduling=async_mode)
    # 10 blocks of 4 tokens cannot hold four sequences of ~20-50 tokens at once.
    outs, (preemptions, free, total) = run(tiny_llama_dir, ids, async_scheduling=async_mode,
                                           num_kv_blocks=14, block_size=4)
    assert preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in base]
    assert free == total


def test_no_chunking_refuses_a_budget_below_the_model_length(tiny_llama_dir):
    """Chunked prefill off and max_model_len unset: a prompt longer than one step's budget could never be
    scheduled and stalled every request behind it. Now the engine refuses to start, naming the field."""
    box: dict[str, BaseException] = {}

    def body() -> None:
        try:
            with LLM(model=str(tiny_llama_dir), enable_chunked_prefill=False, max_num_batched_tokens=64,
                     dtype="float32", show_progress=False) as llm:
                llm.generate([list(range(100, 200))], GREEDY, use_tqdm=False)
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=body, daemon=True)  # a stalled engine fails the test instead of hanging it
    t.start()
    t.join(120)
    assert not t.is_alive(), "the engine stalled on a prompt longer than max_num_batched_tokens"
    err = box.get("error")
    assert isinstance(err, ValueError), err
    assert str(err).startswith("max_num_batched_tokens: 64 is less than max_model_len 1024"), err
    # Still refused the same way when max_model_len is set, and a budget that holds it starts.
    with pytest.raises(ValueError, match="^max_num_batched_tokens: 64"):
        LLM(model=str(tiny_llama_dir), enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=128)
    outs, _ = run(tiny_llama_dir, [list(range(100, 160))], enable_chunked_prefill=False,
                  max_num_batched_tokens=64, max_model_len=64)
    assert len(outs[0].outputs[0].token_ids) == 4  # 60 prompt tokens leave 4 within max_model_len 64

"""Requests the KV cache or the model split cannot hold are refused up front, never left to stall the queue."""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest

from forerun import LLM, SamplingParams
from forerun.config import EngineConfig
from forerun.core.kv_cache_manager import KVCacheManager
from forerun.core.scheduler import Scheduler, SchedulerConfig
from forerun.core.scheduler_output import ModelRunnerOutput
from forerun.request import EngineCoreRequest, Request
from tests.conftest import save_tiny_model

TINY = dict(dtype="float32", show_progress=False)


def within(seconds: float, fn: Callable[[], Any]) -> Any:
    """`fn()`'s result or exception; a call still running after `seconds` fails the test instead of hanging
    it (the stalled thread is a daemon, left to the process's exit)."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the test thread
            box["error"] = exc

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"still running after {seconds} s: the engine stalled"
    if "error" in box:
        raise box["error"]
    return box.get("value")


# ---- start refused when one max_model_len sequence does not fit -----------------------------------

def test_explicit_max_model_len_larger_than_cache_is_refused_at_start(tiny_llama_dir):
    with pytest.raises(ValueError) as info:
        LLM(model=str(tiny_llama_dir), max_model_len=512, num_kv_blocks=8, block_size=16, **TINY)
    msg = str(info.value)
    assert msg.startswith("max_model_len:")
    for word in ("512", "128", "8 blocks", "kv_cache_memory", "num_kv_blocks"):
        assert word in msg, msg
    # The same through a byte budget: 2 layers x K and V x 16 slots x 2 heads x 16 dims x 4 bytes = 8 KiB
    # per block, so 128 KiB holds 16 blocks (256 tokens).
    with pytest.raises(ValueError, match=r"max_model_len: 512 .* holds 256 tokens"):
        LLM(model=str(tiny_llama_dir), max_model_len=512, kv_cache_memory="128KiB", **TINY)


def test_unset_max_model_len_shrinks_to_the_cache_and_every_request_ends(tiny_llama_dir):
    def body() -> tuple[int, list[int], str]:
        with LLM(model=str(tiny_llama_dir), num_kv_blocks=8, block_size=16, **TINY) as llm:
            limit = llm.engine.core.max_model_len
            # No max_tokens: the request runs to max_model_len. Before, it wanted the model's 1024 positions
            # in a 128-slot cache, preempted itself and was never admitted again.
            params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
            outs = llm.generate([[5, 6, 7, 8], [9, 10, 11]], params, use_tqdm=False)
            with pytest.raises(ValueError) as info:
                llm.generate([list(range(100, 300))], use_tqdm=False)
            return limit, [len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs], str(info.value)

    limit, lengths, refused = within(120, body)
    assert limit == 128
    assert lengths == [128, 128]
    assert "max_model_len 128" in refused


# ---- second guard: a request longer than the whole cache is refused, the rest served -------------

class OneTokenRunner:
    """Samples token 7 for every request that reached the end of its known tokens."""

    def run(self, sched, scheduler: Scheduler) -> ModelRunnerOutput:
        ids, sampled = [], []
        for rid in sched.num_scheduled_tokens:
            req = scheduler.requests.get(rid)
            ids.append(rid)
            sampled.append([7] if req is not None and req.num_computed_tokens >= req.num_tokens else [])
        return ModelRunnerOutput(ids, sampled)


def make_request(rid: str, prompt_len: int, max_tokens: int, max_model_len: int = 256) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(EngineCoreRequest(rid, list(range(10, 10 + prompt_len)), params), max_model_len)


def test_request_longer_than_the_cache_is_refused_and_the_rest_are_served():
    # 4 blocks of 4 slots: 16 tokens in all, while max_model_len allows 256.
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256),
                      KVCacheManager(4, 4, enable_caching=True))
    with pytest.raises(ValueError) as info:
        sched.add_request(make_request("big", 10, 20))
    msg = str(info.value)
    assert msg.startswith("max_tokens:") and "8 KV blocks" in msg and "4 blocks" in msg
    assert "kv_cache_memory" in msg and "num_kv_blocks" in msg
    assert "big" not in sched.requests and sched.kv.num_free_blocks == 4  # nothing was touched
    sched.add_request(make_request("a", 5, 6))
    sched.add_request(make_request("b", 6, 4))
    runner, finished = OneTokenRunner(), {}
    for _ in range(100):
        if not sched.has_unfinished_requests():
            break
        step = sched.schedule()
        for out in sched.update_from_output(step, runner.run(step, sched)):
            if out.finish_reason is not None:
                finished[out.request_id] = out.finish_reason
    assert finished == {"a": "length", "b": "length"}
    assert sched.kv.num_free_blocks == 4


# ---- the model split is checked before any worker starts ------------------------------------------

def test_tensor_parallel_split_is_checked_against_the_model_config():
    model = dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, num_hidden_layers=2,
                 max_position_embeddings=1024)
    EngineConfig(tensor_parallel_size=2).check_model(model)  # divides: fine
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: 4 .*num_key_value_heads \(2\)"):
        EngineConfig(tensor_parallel_size=4).check_model(model)
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: 2 .*num_attention_heads \(9\)"):
        EngineConfig(tensor_parallel_size=2).check_model({**model, "num_attention_heads": 9, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: 2 .*intermediate_size \(129\)"):
        EngineConfig(tensor_parallel_size=2).check_model({**model, "intermediate_size": 129})
    with pytest.raises(ValueError, match=r"^pipeline_parallel_size: 3 stages for 2 layers"):
        EngineConfig(pipeline_parallel_size=3, distributed_executor_backend="mp").check_model(model)
    with pytest.raises(ValueError, match=r"^max_model_len: 2048 exceeds the model's limit 1024"):
        EngineConfig(max_model_len=2048).check_model(model)


def test_heads_that_tensor_parallel_cannot_split_fail_before_any_worker_starts(tmp_path, smollm2_dir):
    import psutil
    folder = save_tiny_model(tmp_path / "three-heads", smollm2_dir, hidden_size=48, num_attention_heads=3,
                             num_key_value_heads=3)
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match=r"^tensor_parallel_size: 2 does not divide the model's num_attention_heads"):
        LLM(model=str(folder), tensor_parallel_size=2, **TINY)
    # Refused from config.json: no worker process was ever started (the resource tracker may be new).
    started = [c for c in psutil.Process().children(recursive=True) if c.pid not in before
               and "resource_tracker" not in " ".join(c.cmdline())]
    assert started == []

"""Pipeline parallelism: which steps a request may join, greedy parity with `uni` sync at PP 2, PP 3 and
PP 2 x TP 2 (sync and async, chunked prefill, forced preemption, structured output), per-stage trace
spans that overlap, a killed stage that ends every request with an error, clear errors for bad settings."""

from __future__ import annotations

import argparse
import os
import re
import signal
import threading
import time
from collections import deque
from pathlib import Path

import pytest

from conftest import save_tiny_model
from fake_runner import ScriptedRunner
from forerun import LLM, SamplingParams
from forerun.config import EngineConfig
from forerun.core.kv_cache_manager import KVCacheManager
from forerun.core.pipeline_scheduler import PipelineScheduler
from forerun.core.scheduler import SchedulerConfig
from forerun.engine.engine_core import EngineStepError
from forerun.entrypoints.engine_args import add_engine_args, engine_config_from_args
from forerun.model.parallel import PPStage
from forerun.request import EngineCoreRequest, Request
from test_executors import assert_clean, assert_dead_engine_winds_down, live_children

PROMPTS = ["Hello", "The capital of France is a city that",
           "One two three four five six seven eight nine ten eleven twelve", "Why"]
MAX_TOKENS = 12
# Chunked prefill (8-token budget) and a KV cache of 12 blocks of 4 tokens, too small for all four
# sequences at once: requests are preempted and recomputed.
STRESS = dict(max_num_batched_tokens=8, num_kv_blocks=12, block_size=4)


@pytest.fixture(scope="module")
def pp_model_dir(tmp_path_factory, smollm2_dir) -> Path:
    """Three layers, so two stages split them unevenly (2 + 1); a wide init so greedy outputs vary."""
    return save_tiny_model(tmp_path_factory.mktemp("pp-llama"), smollm2_dir, initializer_range=0.3,
                           num_hidden_layers=3)


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def generate(llm: LLM, prompts: list[str] = PROMPTS) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy(), use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(pp_model_dir) -> list[list[int]]:
    with LLM(model=str(pp_model_dir), distributed_executor_backend="uni", async_scheduling=False,
             dtype="float32", show_progress=False) as llm:
        outs = generate(llm)
    assert len({tuple(t) for t in outs}) == len(PROMPTS) and all(len(set(t)) > 4 for t in outs)
    return outs


# ---- scheduling: which in-flight steps a request may join ----------------------------------------
def _request(rid: str, n: int, base: int) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    return Request(EngineCoreRequest(rid, [base + i for i in range(n)], sp, frozenset({2})), 256)


def _batches(run_ahead: bool) -> tuple[list[dict[str, int]], list[int]]:
    """The engine's batch queue in miniature (depth 2 sync, 3 async, for two stages) over two prompts of
    5 tokens with a 6-token budget; returns each launched step's tokens per request, and how many steps
    were in flight when it was launched."""
    sched = PipelineScheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=6, max_model_len=256),
                              KVCacheManager(32, 4, enable_caching=True), pp_size=2, run_ahead=run_ahead)
    sched.add_request(_request("a", 5, 10))
    sched.add_request(_request("b", 5, 40))
    runner, queue, depth, in_flight = ScriptedRunner(), deque(), 3 if run_ahead else 2, []
    for _ in range(50):
        if not sched.has_unfinished_requests() and not queue:
            break
        pushed = False
        if sched.has_unfinished_requests() and len(queue) < depth:
            so = sched.schedule()
            if not so.is_empty:
                in_flight.append(len(queue))
                queue.append((so, runner.run(so)))
                pushed = True
        if (pushed and len(queue) < depth) or not queue:
            continue
        so, ro = queue.popleft()
        sched.update_from_output(so, ro)
    assert not sched.has_unfinished_requests()
    return runner.batches, in_flight


def test_sync_request_waits_for_its_token_but_not_for_its_next_chunk():
    # b's second chunk joins while its first is in flight (its input is known); a decode waits until the
    # engine has applied the token before it, so a request never sits in two steps that sample for it.
    batches, in_flight = _batches(run_ahead=False)
    assert batches == [{"a": 5, "b": 1}, {"b": 4}, {"a": 1}, {"b": 1}, {"a": 1}, {"b": 1}]
    assert in_flight == [0, 1, 1, 1, 1, 1]


def test_async_decode_joins_once_a_step_lies_between():
    # With three steps in flight a decode may run on a token still in flight, but only when one launched
    # step lies between: the last stage has sampled it by the time the first stage needs it. a and b
    # alternate, so stage 0 runs one while stage 1 runs the other.
    batches, in_flight = _batches(run_ahead=True)
    assert batches == [{"a": 5, "b": 1}, {"b": 4}, {"a": 1}, {"b": 1}, {"a": 1}, {"b": 1}]
    # From the third step on, two steps are in flight at each launch: every decode runs on a token the
    # engine has not seen yet (the one sampled two steps before).
    assert in_flight == [0, 1, 2, 2, 2, 2]


def test_stages_split_layers_contiguously():
    assert [(s.start, s.end) for s in (PPStage.split(i, 3, 8) for i in range(3))] == [(0, 3), (3, 6), (6, 8)]
    assert PPStage.split(1, 2, 5).layers(5) == range(3, 5)
    with pytest.raises(ValueError, match="pipeline_parallel_size: 4 stages for 3 layers"):
        PPStage.split(0, 4, 3)


# ---- settings --------------------------------------------------------------------------------------
def test_bad_settings_name_the_field(pp_model_dir):
    for backend in ("uni", "external_launcher"):
        with pytest.raises(ValueError, match="pipeline_parallel_size: 2 needs the mp or ray executor"):
            EngineConfig(pipeline_parallel_size=2, distributed_executor_backend=backend).validate()
    with pytest.raises(ValueError, match="pipeline_parallel_size: must be a positive integer"):
        EngineConfig(pipeline_parallel_size=0).validate()
    with pytest.raises(ValueError, match="pipeline_parallel_size: pipeline stages serve generation"):
        EngineConfig(pipeline_parallel_size=2, runner="pooling").validate()
    with pytest.raises(ValueError, match="pipeline_parallel_size: 4 stages for 3 layers"):
        LLM(model=str(pp_model_dir), pipeline_parallel_size=4, dtype="float32", show_progress=False)
    assert live_children() == []  # refused before any worker started
    args = add_engine_args(argparse.ArgumentParser()).parse_args(["--pipeline-parallel-size", "2", "-tp", "2"])
    config = engine_config_from_args(args)
    assert (config.pipeline_parallel_size, config.world_size, config.distributed_executor_backend) == (2, 4, "mp")


# ---- end to end (fp32: chunks and stages change a batch's shape, and with it bf16 tokens) ------------
def _stage_overlaps(events) -> int:
    """Steps N for which stage 0 began step N+1's forward before stage 1 finished step N's forward."""
    fwd = {(e.thread, e.step): e for e in events if e.name == "forward"}
    steps = sorted(s for t, s in fwd if t == "forerun-rank1")
    return sum(1 for a, b in zip(steps, steps[1:])
               if ("forerun-rank0", b) in fwd and fwd[("forerun-rank0", b)].begin < fwd[("forerun-rank1", a)].end)


@pytest.mark.parametrize("pp,async_", [(2, False), (2, True)], ids=["pp2-sync", "pp2-async"])
def test_pp_matches_uni_with_chunking_and_preemption(pp_model_dir, reference, pp, async_, track_llm):
    llm = track_llm(LLM(model=str(pp_model_dir), pipeline_parallel_size=pp, async_scheduling=async_, trace=True,
                        dtype="float32", show_progress=False, **STRESS))
    core = llm.engine.core
    assert len(live_children()) == pp and core.queue_depth == pp + async_
    assert generate(llm) == reference
    assert core.scheduler.num_preemptions > 0
    assert core.scheduler.kv.num_free_blocks == core.num_blocks
    events = core.trace.events
    stages = {f"forerun-rank{i}" for i in range(pp)}
    assert {e.thread for e in events if e.name == "forward"} == stages  # one span per stage and step
    forward_steps = [{e.step for e in events if e.name == "forward" and e.thread == t} for t in sorted(stages)]
    assert all(s == forward_steps[0] for s in forward_steps)
    assert _stage_overlaps(events) >= 1
    llm.shutdown()
    assert_clean()


def test_pp2_tp2_async_matches_uni(pp_model_dir, reference, track_llm):
    """Four ranks: two stages of two tensor-parallel ranks, each stage with its own TP group."""
    llm = track_llm(LLM(model=str(pp_model_dir), pipeline_parallel_size=2, tensor_parallel_size=2,
                        async_scheduling=True, dtype="float32", show_progress=False, max_num_batched_tokens=8))
    assert len(live_children()) == 4 and llm.engine.core.executor.output_rank == 2
    assert generate(llm) == reference
    # A prompt cached whole computes only its last token: every stage and rank copies its last block.
    whole = [list(range(100, 132))]
    first = llm.generate(whole, greedy(), use_tqdm=False)
    again = llm.generate(whole, greedy(), use_tqdm=False)
    assert again[0].num_cached_tokens == 31
    assert [list(o.outputs[0].token_ids) for o in again] == [list(o.outputs[0].token_ids) for o in first]
    llm.shutdown()
    assert_clean()


def test_killed_stage_ends_every_request_with_an_error(pp_model_dir, track_llm):
    llm = track_llm(LLM(model=str(pp_model_dir), pipeline_parallel_size=2, async_scheduling=True,
                        dtype="float32", show_progress=False))
    victim = llm.engine.core.executor.procs[0].pid  # the first stage: the last one then waits forever
    killer = threading.Timer(1.0, os.kill, (victim, signal.SIGKILL))
    t0 = time.monotonic()
    killer.start()
    try:
        with pytest.raises(EngineStepError, match=r"rank 0 .*died") as err:
            llm.generate(PROMPTS * 2, greedy(900, ignore_eos=True), use_tqdm=False)
    finally:
        killer.cancel()
    assert time.monotonic() - t0 < 30
    assert len(err.value.outputs) == len(PROMPTS) * 2
    assert all(o.finish_reason == "error" for o in err.value.outputs)
    assert not llm.engine.core.has_unfinished_requests()
    assert_dead_engine_winds_down(llm, PROMPTS)


def test_pp3_async_structured_output_matches_uni(pp_model_dir):
    """PP 3: one layer per stage, so the middle stage both receives and sends activations (and passes the
    first stage's trace spans on). A grammar row whose previous token is still in flight defers its
    sampling; with four steps in flight the engine samples it before launching another step. The tokens
    match uni sync, and every stage reports its spans."""
    from forerun.structured.spec import StructuredOutputsParams
    digits = SamplingParams(temperature=0.0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(regex=r"[0-9]{2,12}"))
    params = [digits, greedy(), digits, greedy()]
    outs = {}
    for name, kw in {"uni": dict(distributed_executor_backend="uni", async_scheduling=False),
                     "pp3": dict(pipeline_parallel_size=3, async_scheduling=True, trace=True)}.items():
        with LLM(model=str(pp_model_dir), dtype="float32", show_progress=False, max_num_batched_tokens=8, **kw) as llm:
            outs[name] = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
            if name == "pp3":
                events = llm.engine.core.trace.events
                assert any(e.name == "schedule" and e.args.get("deferred_sampling") for e in events)
                assert {e.thread for e in events if e.name == "forward"} == {f"forerun-rank{i}" for i in range(3)}
                assert {e.thread for e in events if e.name == "recv"} == {"forerun-rank1", "forerun-rank2"}
            else:
                texts = [llm.tokenizer.decode(t) for t in outs[name][::2]]
                assert all(re.fullmatch(r"[0-9]{2,12}", t) for t in texts), texts
    assert outs["pp3"] == outs["uni"]
    assert_clean()

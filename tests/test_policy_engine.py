"""Prefill/decode policies and priority through the engine on a tiny fp32 model: tokens never depend on them."""

from __future__ import annotations

import argparse

import pytest

from forerun import LLM, SamplingParams
from forerun.config import EngineConfig
from forerun.core.step_policy import Phase
from forerun.engine.llm_engine import LLMEngine
from forerun.entrypoints.engine_args import add_engine_args, engine_config_from_args
from tests.test_engine_parity import PROMPTS, token_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def run_steps(engine: LLMEngine, prompts: list[list[int]], priorities: list[int] | None = None):
    """Step the engine to the end; return tokens per prompt, the phase of every scheduled step, and the
    order in which requests finished."""
    ids = [engine.add_request(p, GREEDY, priority=(priorities[i] if priorities else 0))
           for i, p in enumerate(prompts)]
    tokens: dict[str, list[int]] = {}
    phases: list[Phase] = []
    finished: list[str] = []
    step_id = engine.core.scheduler.step_id
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
                finished.append(out.request_id)
        if engine.core.scheduler.step_id != step_id:  # this call scheduled a step
            step_id = engine.core.scheduler.step_id
            if engine.core.scheduler.last_step_phase is not None:
                phases.append(engine.core.scheduler.last_step_phase)
    return [tokens[i] for i in ids], phases, [ids.index(r) for r in finished]


def engine(folder, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), dtype="float32", **kw), show_progress=False)


@pytest.fixture(scope="module")
def workload(tiny_llama_dir) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts (one repeats an earlier one: prefix-cache hits) and their tokens from a plain sync engine."""
    ids = token_prompts(tiny_llama_dir, PROMPTS) + token_prompts(tiny_llama_dir, PROMPTS[1:2])
    ref = engine(tiny_llama_dir, async_scheduling=False)
    try:
        return ids, run_steps(ref, ids)[0]
    finally:
        ref.shutdown()


@pytest.mark.parametrize("async_mode", [False, True])
def test_policies_give_identical_tokens(tiny_llama_dir, workload, async_mode):
    # A budget of 8 chunks every prompt; 14 blocks of 4 slots cannot hold all five sequences, so requests
    # are preempted and recomputed.
    ids, want = workload
    for policy in ("mixed", "split", "prefill-first"):
        eng = engine(tiny_llama_dir, async_scheduling=async_mode, prefill_decode_policy=policy,
                     max_num_batched_tokens=8, num_kv_blocks=14, block_size=4)
        try:
            got, phases, _ = run_steps(eng, ids)
            sched = eng.core.scheduler
            assert got == want, policy
            assert sched.num_preemptions > 0, policy
            assert sched.kv.stats.hit_tokens > 0, policy
            assert sched.kv.num_free_blocks == eng.core.num_blocks, f"{policy}: blocks leaked"
            if policy == "mixed":
                assert set(phases) == {Phase.ANY}
            else:
                assert set(phases) == {Phase.PREFILL, Phase.DECODE}, policy
        finally:
            eng.shutdown()


def test_priority_orders_requests_and_fcfs_refuses_it(tiny_llama_dir):
    ids = token_prompts(tiny_llama_dir, PROMPTS[:3])
    eng = engine(tiny_llama_dir, scheduling_policy="priority", max_num_seqs=1)
    try:
        tokens, _, order = run_steps(eng, ids, priorities=[3, -1, 0])
        assert order == [1, 2, 0]  # one request at a time, lowest value first
    finally:
        eng.shutdown()
    with LLM(model=str(tiny_llama_dir), dtype="float32", show_progress=False) as llm:
        with pytest.raises(ValueError, match="priority: got 2 but priority scheduling is off"):
            llm.generate(ids, GREEDY, use_tqdm=False, priority=[0, 2, 0])
        with pytest.raises(ValueError, match="priority: expected a list of 3"):
            llm.generate(ids, GREEDY, use_tqdm=False, priority=[0])
        outs = llm.generate(ids, GREEDY, use_tqdm=False, priority=[0, 0, 0])
        assert [o.outputs[0].token_ids for o in outs] == tokens  # priority changes order, never tokens


def test_cli_flags_build_the_config():
    parser = add_engine_args(argparse.ArgumentParser())
    cfg = engine_config_from_args(parser.parse_args([]))
    assert (cfg.prefill_decode_policy, cfg.split_interleave_steps, cfg.scheduling_policy) == ("mixed", 1, "fcfs")
    cfg = engine_config_from_args(parser.parse_args(["--prefill-decode-policy", "split", "--split-interleave-steps",
                                                     "3", "--scheduling-policy", "priority"]))
    assert (cfg.prefill_decode_policy, cfg.split_interleave_steps, cfg.scheduling_policy) == ("split", 3, "priority")
    with pytest.raises(ValueError, match="split_interleave_steps: must be a positive integer"):
        engine_config_from_args(parser.parse_args(["--split-interleave-steps", "0"]))
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo").validate()

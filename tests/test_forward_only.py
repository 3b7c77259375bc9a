"""The forward-only replay keeps launched steps by reference: no step may change after its launch."""

from __future__ import annotations

import pickle

import pytest

from forerun.bench.forward_only import record_steps, replay
from forerun.config import EngineConfig
from forerun.engine.llm_engine import LLMEngine
from forerun.sampling_params import SamplingParams


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_launched_steps_never_change_and_replay_as_launched(tiny_llama_dir, async_scheduling):
    """Preemption (a small cache), chunked prefill, prefix hits, speculation and stops all run here; a
    snapshot taken at launch must still equal each kept step at the end, and a fresh engine's executor
    must accept the kept steps as they are."""
    config = EngineConfig(model=str(tiny_llama_dir), max_model_len=96, num_kv_blocks=12, block_size=8,
                          max_num_batched_tokens=40, async_scheduling=async_scheduling,
                          speculative_config={"num_speculative_tokens": 2})
    engine = LLMEngine(config, show_progress=False)
    try:
        record = record_steps(engine, keep=True)
        snapshots: list[bytes] = []
        launch = engine.core.executor.execute_model

        def snapshot_then_launch(step, non_block=False):
            snapshots.append(pickle.dumps(step))  # before the worker can see it
            return launch(step, non_block)  # the recording proxy keeps `step` itself

        engine.core.executor.execute_model = snapshot_then_launch
        shared = list(range(40, 70))  # a common prefix: later prompts hit the prefix cache
        for i in range(6):
            engine.add_request(shared + [100 + i] * (3 + 5 * i),
                               SamplingParams(max_tokens=12 + i, ignore_eos=i % 2 == 0, stop_token_ids=[7]))
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.core.scheduler.num_preemptions > 0, "the cache is meant to be too small for all six"
    finally:
        engine.shutdown()
    assert len(record.steps) == len(snapshots) > 10
    changed = [i for i, (step, snap) in enumerate(zip(record.steps, snapshots)) if pickle.dumps(step) != snap]
    assert not changed, f"steps {changed} changed after their launch"
    fresh = LLMEngine(config, show_progress=False)
    try:
        assert replay(fresh, record.steps) > 0
    finally:
        fresh.shutdown()


def test_warm_up_runs_the_largest_steps_without_caching_the_timed_prompts(tiny_llama_dir):
    """The benchmark's warm-up fills the token budget in one step (so the timed run and its replay find
    the heap grown alike), and leaves no prefix-cache hit for the timed prompts beyond the first two."""
    from forerun.bench.throughput import _warm_up
    from forerun.bench.workloads import random_workload

    config = EngineConfig(model=str(tiny_llama_dir), max_num_batched_tokens=64, block_size=8)
    workload = random_workload(256, num_prompts=12, input_len=16, output_len=4, vary=False, ignore_eos=True)
    engine = LLMEngine(config, show_progress=False)
    try:
        record = record_steps(engine, keep=True)
        _warm_up(engine, workload)
        assert max(s.total_num_scheduled_tokens for s in record.steps) == 64
        for prompt, params in zip(workload.prompts, workload.params):
            engine.add_request(prompt, params)
        cached: list[int] = []
        while engine.has_unfinished_requests():
            cached += [out.num_cached_tokens for out in engine.step() if out.finished]
    finally:
        engine.shutdown()
    assert len(cached) == 12 and sorted(cached)[:10] == [0] * 10, cached


def test_warm_up_runs_each_matmul_shape_at_every_decode_row_bucket(tiny_llama_dir):
    """The benchmark's warm-up runs every dense matmul shape at each row count a step of up to
    max_num_seqs rows runs it at, so that kernels compiled per shape (oneDNN's) are compiled before the
    timed run, as they are before its replay."""
    from forerun.bench.throughput import _warm_up
    from forerun.bench.workloads import random_workload
    from forerun.kernels.linear import row_bucket
    from forerun.model.layers import PackableLinear

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), max_num_seqs=40), show_progress=False)
    try:
        rows_by_shape: dict[tuple[int, ...], set[int]] = {}
        for module in engine.core.executor.worker.model.modules():
            if isinstance(module, PackableLinear) and module.blocks is None:
                shape = module.dense_shape or tuple(module.weight.shape)

                def recording(x, with_bias=True, _real=module.matmul, _shape=shape):
                    rows_by_shape.setdefault(_shape, set()).add(x.shape[0])
                    return _real(x, with_bias)

                module.matmul = recording
        _warm_up(engine, random_workload(256, num_prompts=4, input_len=8, output_len=2, vary=False,
                                         ignore_eos=True))
    finally:
        engine.shutdown()
    buckets = {row_bucket(n) for n in range(1, 41)}
    assert len(buckets) == 26 and len(rows_by_shape) >= 4
    assert all(buckets <= rows for rows in rows_by_shape.values()), rows_by_shape

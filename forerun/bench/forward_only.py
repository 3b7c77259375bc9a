"""The model alone: replay the steps an engine scheduled straight into its executor, with no engine.

`record_steps` keeps every SchedulerOutput an engine launches (when a replay will need them);
`replay` feeds the same list to an engine's executor (forward, then sampling, per step) without
scheduling, output processing or detokenizing. The worker is deterministic in what it is sent, so the
replay runs exactly the same batch shapes: throughput over replay throughput is the share of time the
engine's own work costs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from forerun.core.scheduler_output import SchedulerOutput
from forerun.engine.llm_engine import LLMEngine


@dataclass
class StepRecord:
    """What an engine launched: its scheduled tokens, and copies of the steps when kept for a replay."""

    steps: list[SchedulerOutput] = field(default_factory=list)
    scheduled_tokens: int = 0


def record_steps(engine: LLMEngine, keep: bool) -> StepRecord:
    """From now on, count the tokens of every step `engine` launches (a proxy around execute_model),
    and with `keep` also keep each step for a replay.

    Steps are kept by reference: neither the engine nor the worker changes a step once it is launched
    (tests/test_forward_only.py checks it), and a copy here would cost the engine thread about
    0.1 ms a step at 64 requests, time a real engine does not spend and the engine's share would count.
    """
    record = StepRecord()
    executor = engine.core.executor
    launch = executor.execute_model

    def recording(scheduler_output: SchedulerOutput, non_block: bool = False) -> Any:
        record.scheduled_tokens += scheduler_output.total_num_scheduled_tokens
        if keep:
            record.steps.append(scheduler_output)
        return launch(scheduler_output, non_block)

    executor.execute_model = recording  # type: ignore[method-assign]
    return record


def replay(engine: LLMEngine, steps: list[SchedulerOutput]) -> float:
    """Seconds to run `steps` through `engine`'s executor, one forward and one sampling call each."""
    executor = engine.core.executor
    execute = type(executor).execute_model  # the executor's own method, never a recording proxy
    start = time.perf_counter()
    for step in steps:
        execute(executor, step)
        executor.sample_tokens(None)
    return time.perf_counter() - start


def matmul_flops(scheduled_tokens: int, sampled_tokens: int, shapes: list[tuple[int, int, int]]) -> float:
    """FLOPs of a run's matmuls: every scheduled token passes the layers, sampled rows the LM head.
    (`shapes` ends with the LM head, as `model_matmul_shapes` returns them; attention is left out.)"""
    per_token = sum(2.0 * k * n * c for k, n, c in shapes[:-1])
    k, n, c = shapes[-1]
    return scheduled_tokens * per_token + sampled_tokens * 2.0 * k * n * c

"""For engines started once per rank by an outside launcher (`torchrun`), e.g. inside an RL training loop.

Usage, in a script run with `torchrun --nproc-per-node N script.py`:

    llm = LLM(model=..., distributed_executor_backend="external_launcher", tensor_parallel_size=N)
    outs = llm.generate(prompts, SamplingParams(temperature=0))  # the same outputs on every rank
    llm.shutdown()
    torch.distributed.destroy_process_group()  # the engine leaves the group to the script

Every rank builds its own engine over the same inputs, schedules the same steps and runs the same
calls, so the ranks' collectives pair up without any driver; each rank gets the full outputs.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from forerun.config import EngineConfig
from forerun.core.scheduler_output import GrammarOutput, ModelRunnerOutput
from forerun.executor.base import Executor
from forerun.worker.extension import with_extension
from forerun.worker.worker import Worker


class EveryRankWorker(Worker):
    """A Worker whose `sample_tokens` returns the output on every rank, not only rank 0, and which leaves
    the default process group alone on shutdown.

    Invariants: with identical inputs and seeds every rank samples the same tokens, so any rank's output
    is the output; the process group belongs to the launched process (a training loop may share it, and
    a later engine in the same process reuses it), so the script destroys it, not the engine.
    """

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput | None:
        assert self.runner is not None
        return self.runner.sample_tokens(grammar_output)

    def shutdown(self) -> None:
        self.runner = None


def launcher_rank() -> tuple[int, int]:
    """(rank, world size) from the variables torchrun sets; ValueError naming the one missing."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise ValueError(f"{name}: environment variable not set; the external_launcher backend must be "
                             "started by torchrun (or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)")
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


class ExternalLauncherExecutor(Executor):
    """This rank's worker, in this process; the launcher started the other ranks.

    Invariants: WORLD_SIZE equals tensor_parallel_size; in async mode every call runs on one worker
    thread in submission order (so the forward overlaps this rank's scheduling of the next step), in
    sync mode inline; every rank calls `all_ranks_true` at the same points of its step loop (the
    engines' states are equal), so those all-reduces pair up.
    """

    def __init__(self, config: EngineConfig, model_folder: Path) -> None:
        rank, world_size = launcher_rank()
        if world_size != config.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size: {config.tensor_parallel_size} does not match the "
                             f"launcher's WORLD_SIZE {world_size}")
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix=f"forerun-rank{rank}")
                      if config.async_scheduling else None)
        worker_cls = with_extension(EveryRankWorker, config.worker_extension_cls)
        self.worker = self._run(lambda: worker_cls(config, model_folder, rank, world_size, "env://"))
        # A CPU group of its own, so the engine thread can agree with the other ranks while this
        # rank's worker thread runs the forward's collectives on the default group.
        self._agree_group = dist.new_group(backend="gloo") if world_size > 1 else None

    def _run(self, fn):
        return fn() if self._pool is None else self._pool.submit(fn).result()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       non_block: bool = False) -> list[Any] | Future:
        # Only this rank's result exists here; the others hold equal ones, so it stands for all.
        def call() -> list[Any]:
            return [getattr(self.worker, method)(*args, **(kwargs or {}))]

        if self._pool is not None:
            fut = self._pool.submit(call)
            return fut if non_block else fut.result()
        if not non_block:
            return call()
        done: Future = Future()
        try:
            done.set_result(call())
        except Exception as exc:  # the caller sees it when it waits, as with a remote worker
            done.set_exception(exc)
        return done

    def every_rank(self, results: list[Any]) -> list[Any]:
        """This rank's result joined with every other rank's (all ranks make the same trainer calls in the
        same order, as they make the same generate calls), so each rank sees one result per rank."""
        if self._agree_group is None:
            return results
        gathered: list[Any] = [None] * dist.get_world_size(self._agree_group)
        dist.all_gather_object(gathered, results[0], group=self._agree_group)
        return gathered

    def all_ranks_true(self, flags: list[bool]) -> list[bool]:
        if self._agree_group is None or not flags:
            return flags
        agreed = torch.tensor(flags, dtype=torch.int32)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self._agree_group)
        return [bool(v) for v in agreed.tolist()]

    def shutdown(self) -> None:
        if self._agree_group is not None and dist.is_initialized():
            dist.destroy_process_group(self._agree_group)
        self._agree_group = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

"""The in-process executor: one worker, run on a worker thread when async scheduling is on."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from forerun.config import EngineConfig
from forerun.core.scheduler_output import GrammarOutput, ModelRunnerOutput
from forerun.executor.base import Executor
from forerun.platform import lower_model_thread_priority
from forerun.worker.extension import with_extension
from forerun.worker.worker import Worker


class UniExecutor(Executor):
    """One worker in this process, on its own thread, in both modes.

    Every call goes to a single worker thread, so calls complete in submission order; in async mode
    the forward pass runs there while the engine thread schedules the next step (PyTorch releases the
    GIL inside its kernels). Sync mode uses the same thread so that all of the model's work happens on
    one thread: each thread that runs parallel ops gets its own OpenMP pool, and two pools on two cores
    oversubscribe them, which makes libgomp sleep between parallel regions and small ops several times
    slower (measured in the README's benchmark notes).
    """

    def __init__(self, config: EngineConfig, model_folder: Path) -> None:
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(
            1, thread_name_prefix="forerun-worker", initializer=lower_model_thread_priority)
        worker_cls = with_extension(Worker, config.worker_extension_cls)
        self.worker = self._pool.submit(worker_cls, config, model_folder).result()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       non_block: bool = False) -> list[Any] | Future:
        fut = self._submit(lambda: [getattr(self.worker, method)(*args, **(kwargs or {}))])
        return fut if non_block else fut.result()

    def _submit(self, fn: Any, *args: Any) -> Future:
        """`fn(*args)` on the worker thread."""
        if self._pool is None:
            raise RuntimeError("executor is shut down")
        return self._pool.submit(fn, *args)

    def sample_tokens(self, grammar_output: GrammarOutput | None,
                      non_block: bool = False) -> ModelRunnerOutput | Future:
        """The one worker's result itself: no list of ranks, and no second Future picking from it (a
        step's sampling is waited on every step, and each Future and callback costs its lock calls)."""
        fut = self._submit(self.worker.sample_tokens, grammar_output)
        return fut if non_block else fut.result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

"""The in-process executor: one worker, run on a worker thread when async scheduling is on."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from forerun.config import EngineConfig
from forerun.executor.base import Executor
from forerun.worker.worker import Worker


class UniExecutor(Executor):
    """One worker in this process.

    In async mode every call goes to a single worker thread, so the forward pass runs while the
    engine thread schedules the next step (PyTorch releases the GIL inside its kernels) and calls
    complete in submission order. In sync mode calls run inline: no thread hop to pay for.
    """

    def __init__(self, config: EngineConfig, model_folder: Path) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="forerun-worker") if config.async_scheduling else None
        self._lock = threading.Lock()
        self.worker = self._run(lambda: Worker(config, model_folder))

    def _run(self, fn):
        return fn() if self._pool is None else self._pool.submit(fn).result()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       non_block: bool = False) -> list[Any] | Future:
        call = lambda: [getattr(self.worker, method)(*args, **(kwargs or {}))]  # noqa: E731
        if self._pool is None:
            if not non_block:
                return call()
            fut: Future = Future()
            try:
                fut.set_result(call())
            except Exception as exc:  # the caller sees it when it waits, as with a real worker
                fut.set_exception(exc)
            return fut
        fut = self._pool.submit(call)
        return fut if non_block else fut.result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

"""One worker process per rank (pipeline stages x tensor-parallel ranks), fed through a shared-memory
broadcast queue."""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import queue
import socket
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forerun.config import EngineConfig
from forerun.executor.base import Executor
from forerun.executor.shm_queue import EMPTY, QueueTimeout, ShmBroadcastQueue, ShmQueueHandle, ShmReader, ShmWriter
from forerun.executor.spawn import main_script_not_rerun
from forerun.heap import settle_start_garbage

logger = logging.getLogger(__name__)

# Step calls: only the output rank's result is wanted, so the other ranks answer only when they fail.
RANK0_ONLY = frozenset({"execute_model", "sample_tokens"})
_STOP = "__stop__"
_READY = -1  # call id of the "worker constructed" message
STARTUP_TIMEOUT_S = 600.0
JOIN_TIMEOUT_S = 10.0


class WorkerError(RuntimeError):
    """A worker rank failed or died; the executor is unusable afterwards."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class _Pending:
    call_id: int
    method: str
    future: Future
    ranks: set[int]  # ranks whose answer is still awaited
    results: dict[int, Any] = field(default_factory=dict)


class MultiprocExecutor(Executor):
    """Spawns `pipeline_parallel_size x tensor_parallel_size` worker processes and drives them in lockstep.

    Invariants: every rank receives every call, in the order `collective_rpc` was called; Futures
    resolve in that order (one response thread); a worker exception or a worker death fails the pending
    call and every later one, and from then on every call raises `WorkerError`; `shutdown()` leaves no
    process, thread or shared-memory segment behind.
    """

    remote_workers = True

    def __init__(self, config: EngineConfig, model_folder: Path) -> None:
        if config.pipeline_parallel_size > 1:  # a clear error now rather than from every worker later
            from forerun.model.registry import check_pipeline_stages
            check_pipeline_stages(model_folder, config.pipeline_parallel_size)
        self.world_size = config.world_size
        self.output_rank = self.world_size - config.tensor_parallel_size  # the last stage samples
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pending: deque[_Pending] = deque()
        self._next_id = 0
        self._error: WorkerError | None = None
        self._closed = False  # no new calls; shutdown() has begun
        self._torn_down = False  # shutdown() has finished: no process, thread or segment left
        self._stopping = threading.Event()
        ctx = mp.get_context("spawn")
        self._calls = ShmBroadcastQueue(self.world_size, n_slots=8, slot_bytes=1 << 20)
        self._responses = [ShmBroadcastQueue(1, n_slots=8, slot_bytes=1 << 20) for _ in range(self.world_size)]
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.procs = [ctx.Process(target=_worker_main, name=f"forerun-rank{r}", daemon=True,
                                  args=(config, model_folder, r, self.world_size, init_method,
                                        self._calls.handle, self._responses[r].handle, os.getpid()))
                      for r in range(self.world_size)]
        self._writer = ShmWriter(self._calls.handle)
        self._readers = [ShmReader(q.handle, 0) for q in self._responses]
        ready: Future = Future()
        self._pending.append(_Pending(_READY, "__init__", ready, set(range(self.world_size))))
        self._resp_thread = threading.Thread(target=self._response_loop, name="forerun-mp-responses", daemon=True)
        self._monitor = threading.Thread(target=self._monitor_loop, name="forerun-mp-monitor", daemon=True)
        # An engine nobody shut down is shut down at interpreter exit, before multiprocessing's own exit
        # hook (registered earlier, so run later) terminates the workers and the resource tracker
        # reports the rings as leaked.
        atexit.register(self.shutdown)
        try:
            with main_script_not_rerun():
                for p in self.procs:
                    p.start()
            self._resp_thread.start()
            self._monitor.start()
            ready.result(timeout=STARTUP_TIMEOUT_S)
        except BaseException as exc:
            # A worker's error leaves the others waiting for orders: stop them in order. An interrupt
            # (a signal) means exit now.
            self.shutdown(None if isinstance(exc, Exception) else 0.0)
            raise

    # ---- calls ---------------------------------------------------------------------------------
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       non_block: bool = False) -> list[Any] | Future:
        rank0_only = method in RANK0_ONLY
        fut: Future = Future()
        with self._cond:
            if method == "shutdown" and (self._error is not None or self._closed):
                # Failed or closed workers have nothing left to tear down; `shutdown()` ends them.
                return _done([None] * self.world_size) if non_block else [None] * self.world_size
            if self._error is not None:
                raise self._error
            if self._closed:
                raise WorkerError("executor is shut down")
            call_id = self._next_id
            self._next_id += 1
            self._pending.append(_Pending(call_id, method, fut,
                                          {self.output_rank} if rank0_only else set(range(self.world_size))))
            self._cond.notify_all()
        # Broadcast outside the lock: a full ring waits here for slow workers while the response
        # thread keeps resolving (and freeing) earlier calls.
        self._put((call_id, method, args, kwargs or {}, rank0_only))
        return fut if non_block else fut.result()

    def _put(self, msg: tuple) -> None:
        while True:
            if self._error is not None:
                raise self._error
            try:
                self._writer.put(msg, timeout=0.5)
                return
            except QueueTimeout:
                continue

    def check_health(self) -> None:
        if self._error is not None:
            raise self._error
        for r, p in enumerate(self.procs):
            if not p.is_alive():
                raise WorkerError(f"worker rank {r} (pid {p.pid}) is not running (exit code {p.exitcode})")

    # ---- response thread: resolves Futures in call order ---------------------------------------
    def _response_loop(self) -> None:
        sleep = 10e-6
        spin_until = time.perf_counter() + 2e-3
        while True:
            with self._cond:
                while not self._pending and not self._stopping.is_set():
                    self._cond.wait()
                    spin_until = time.perf_counter() + 2e-3
                if self._stopping.is_set():
                    return
            got = False
            for rank, reader in enumerate(self._readers):
                msg = reader.try_get()
                if msg is not EMPTY:
                    got = True
                    self._on_response(rank, msg)
            if got:
                sleep, spin_until = 10e-6, time.perf_counter() + 2e-3
            elif time.perf_counter() < spin_until:
                os.sched_yield()
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, 500e-6)

    def _on_response(self, rank: int, msg: tuple) -> None:
        call_id, ok, payload = msg
        with self._cond:
            entry = next((p for p in self._pending if p.call_id == call_id), None)
            if entry is None:
                return  # the call was already failed
            if not ok:
                name = "starting the worker" if call_id == _READY else entry.method
                # A peer's death shows up first as a broken collective on the survivors: name the cause.
                dead = [f"rank {r} (pid {p.pid}) died with exit code {p.exitcode}"
                        for r, p in enumerate(self.procs) if not p.is_alive()]
                cause = f"worker {'; '.join(dead)}; " if dead else ""
                self._fail(WorkerError(f"{cause}worker rank {rank} failed in {name}: {payload}"))
                return
            entry.results[rank] = payload
            entry.ranks.discard(rank)
            done = []
            while self._pending and not self._pending[0].ranks:
                done.append(self._pending.popleft())
        for p in done:
            results = [p.results.get(r) for r in range(self.world_size)]
            p.future.set_result(results)

    def _fail(self, error: WorkerError) -> None:
        """Fail every pending call (caller holds the lock)."""
        if self._error is None:
            self._error = error
            if not self._closed:
                logger.error("%s", error)
        pending, self._pending = list(self._pending), deque()
        for p in pending:
            if not p.future.done():
                p.future.set_exception(self._error)

    # ---- monitor: a worker that dies fails everything at once ----------------------------------
    def _monitor_loop(self) -> None:
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while not self._stopping.is_set():
            ready = mp.connection.wait(list(sentinels), timeout=0.2)
            if not ready or self._closed or not threading.main_thread().is_alive():
                continue  # after shutdown() began, or at interpreter exit, workers exiting is the plan
            rank = sentinels[ready[0]]
            proc = self.procs[rank]
            proc.join(timeout=1.0)  # so its exit code is known
            with self._cond:
                self._fail(WorkerError(f"worker rank {rank} (pid {proc.pid}) died unexpectedly "
                                       f"(exit code {proc.exitcode})"))
            # The other ranks may sit in a collective that will never complete: end them now.
            self._kill_all()
            return

    def _kill_all(self) -> None:
        started = [p for p in self.procs if p.pid is not None]
        for p in started:
            if p.is_alive():
                p.kill()
        for p in started:
            p.join(timeout=JOIN_TIMEOUT_S)

    # ---- shutdown ------------------------------------------------------------------------------
    def kill(self) -> None:
        """End every worker at once, mid-step or not, and free the rings (the process is exiting now)."""
        self.shutdown(0.0)

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop the workers, giving them `timeout_s` to exit after the stop message before they are killed
        (None: 10 s, or 2 s after a failure; 0: kill at once), then free threads and shared memory.

        Idempotent, and a call interrupted part way (a signal) is finished by the next one.
        """
        with self._cond:
            if self._torn_down:
                return
            first, self._closed = not self._closed, True
        # After a failure a rank may sit in a collective that never completes: wait less for it.
        patience = timeout_s if timeout_s is not None else JOIN_TIMEOUT_S if self._error is None else 2.0
        if first and patience > 0 and all(p.pid is not None and p.is_alive() for p in self.procs):
            try:
                self._writer.put((-2, _STOP, (), {}, False), timeout=patience)
            except QueueTimeout:
                logger.warning("workers did not take the stop message; killing them")
        deadline = time.monotonic() + patience
        for p in self.procs:
            if p.pid is not None and patience > 0:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        self._stopping.set()
        self._kill_all()
        with self._cond:
            self._fail(self._error or WorkerError("executor shut down"))
            self._cond.notify_all()
        for t in (self._resp_thread, self._monitor):
            if t.ident is not None:
                t.join()
        self._writer.close()
        for r in self._readers:
            r.close()
        self._calls.close()
        for q in self._responses:
            q.close()
        self._torn_down = True
        atexit.unregister(self.shutdown)


# ---- worker process --------------------------------------------------------------------------
def _worker_main(config: EngineConfig, model_folder: Path, rank: int, world_size: int, init_method: str,
                 calls: ShmQueueHandle, responses: ShmQueueHandle, parent_pid: int) -> None:
    threading.current_thread().name = f"forerun-rank{rank}"
    logging.basicConfig(level=logging.WARNING)
    out: queue.Queue = queue.Queue()
    writer = ShmWriter(responses)
    sender = threading.Thread(target=_output_loop, args=(out, writer, parent_pid), name=f"forerun-rank{rank}-out")
    sender.start()
    reader = ShmReader(calls, rank)
    try:
        worker = _build_worker(config, model_folder, rank, world_size, init_method)
    except Exception as exc:
        out.put((_READY, False, _describe(exc)))
        worker = None
    else:
        settle_start_garbage(freeze=True)  # this process is the worker's own
        out.put((_READY, True, None))
    try:
        while True:
            try:
                call_id, method, args, kwargs, rank0_only = reader.get(timeout=1.0)
            except QueueTimeout:
                if os.getppid() != parent_pid:
                    break  # the engine process is gone: do not linger as an orphan
                continue
            if method == _STOP:
                break
            if worker is None:  # stay until told to stop, so the start-up error is what the engine sees
                out.put((call_id, False, "the worker failed to start"))
                continue
            try:
                result = getattr(worker, method)(*args, **kwargs)
            except Exception as exc:
                out.put((call_id, False, _describe(exc)))
                continue
            if not rank0_only or rank == world_size - config.tensor_parallel_size:  # the output rank
                out.put((call_id, True, result))
    finally:
        out.put(None)
        sender.join()
        reader.close()
        writer.close()


def _build_worker(config: EngineConfig, model_folder: Path, rank: int, world_size: int, init_method: str):
    import torch

    from forerun.worker.extension import with_extension
    from forerun.worker.worker import Worker
    if config.num_threads is None and not torch.cuda.is_available():
        # Ranks share the machine's cores; the default (all cores per rank) would oversubscribe them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    return with_extension(Worker, config.worker_extension_cls)(config, model_folder, rank, world_size, init_method)


def _output_loop(out: queue.Queue, writer: ShmWriter, parent_pid: int) -> None:
    """Sends results in order. An async result (`get_output()`) is waited for here, so the rank's main
    loop goes on to the next call while the device-to-host copy finishes."""
    while (item := out.get()) is not None:
        call_id, ok, payload = item
        if ok and hasattr(payload, "get_output"):
            try:
                payload = payload.get_output()
            except Exception as exc:
                ok, payload = False, _describe(exc)
        while True:
            try:
                writer.put((call_id, ok, payload), timeout=1.0)
                break
            except QueueTimeout:
                if os.getppid() != parent_pid:
                    return
            except Exception as exc:  # e.g. a result that cannot be pickled
                writer.put((call_id, False, _describe(exc)), timeout=None)
                break


def _done(value: Any) -> Future:
    fut: Future = Future()
    fut.set_result(value)
    return fut


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}\n{''.join(traceback.format_exception(exc))}"

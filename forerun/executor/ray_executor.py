"""Workers as Ray actors, on one node or many.

Single node: nothing to set up; the engine starts a local Ray instance if none is running
(`ray.init()` also joins the cluster named by RAY_ADDRESS).

Multi-node, e.g. tensor parallel 4 over two machines with two GPUs each:

    # on the head node
    ray start --head --port 6379
    # on every other node (forerun and the model files at the same paths as on the head)
    ray start --address <head-ip>:6379
    # on the head node
    forerun serve <model> --distributed-executor-backend ray -tp 4

The engine asks for a placement group of one bundle per rank ({"GPU": 1, "CPU": 1} when the cluster
has a GPU per rank, else {"CPU": 1}) packed onto as few nodes as possible, starts one actor per
bundle, and rank 0's node address serves as the torch.distributed rendezvous.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forerun.config import EngineConfig
from forerun.executor.base import Executor
from forerun.executor.mp import RANK0_ONLY, WorkerError

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0


def _import_ray():
    try:
        import ray
    except ImportError as exc:
        raise ValueError("distributed_executor_backend: 'ray' needs the ray package (pip install ray)") from exc
    return ray


class RayWorkerActor:
    """Holds one rank's Worker inside a Ray actor process; calls arrive in submission order."""

    def __init__(self) -> None:
        self.worker = None

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it, for the rendezvous of rank 0."""
        import ray
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return ray.util.get_node_ip_address(), port

    def init_worker(self, config: EngineConfig, model_folder: Path, rank: int, world_size: int,
                    init_method: str, num_cpus: int) -> int:
        import torch

        from forerun.worker.extension import with_extension
        from forerun.worker.worker import Worker
        if config.num_threads is None and not torch.cuda.is_available():
            torch.set_num_threads(max(1, num_cpus))  # the bundle's share, not the whole node
        worker_cls = with_extension(Worker, config.worker_extension_cls)
        self.worker = worker_cls(config, model_folder, rank, world_size, init_method)
        return os.getpid()

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)


@dataclass
class _Call:
    method: str
    refs: list  # one ray.ObjectRef per rank
    future: Future


class RayExecutor(Executor):
    """One Ray actor per rank, each in its own bundle of a placement group.

    Invariants: every actor receives every call in the order `collective_rpc` was called (Ray keeps one
    caller's calls to one actor in order); one resolver thread resolves the Futures in that order; an
    error or a dead actor fails that call and every later one, and from then on every call raises.
    """

    remote_workers = True

    def __init__(self, config: EngineConfig, model_folder: Path) -> None:
        ray = _import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init()
        if config.pipeline_parallel_size > 1:  # a clear error now rather than from every actor later
            from forerun.model.registry import check_pipeline_stages
            check_pipeline_stages(model_folder, config.pipeline_parallel_size)
        self.world_size = ws = config.world_size
        self.output_rank = ws - config.tensor_parallel_size  # the last pipeline stage samples
        use_gpu = ray.cluster_resources().get("GPU", 0) >= ws
        bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
        self.pg = placement_group([dict(bundle) for _ in range(ws)], strategy="PACK")
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pending: deque[_Call] = deque()
        self._error: WorkerError | None = None
        self._closed = False
        self.actors: list = []
        self._resolver = threading.Thread(target=self._resolve_loop, name="forerun-ray-resolver", daemon=True)
        try:
            ready, _ = ray.wait([self.pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
            if not ready:
                raise ValueError(f"tensor_parallel_size: the Ray cluster cannot place {ws} bundles of "
                                 f"{bundle} (resources: {ray.available_resources()})")
            # Actors must import forerun even where it is not installed as a package (a source checkout).
            src = str(Path(__file__).resolve().parents[2])  # the folder holding the forerun package
            path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
            actor_cls = ray.remote(RayWorkerActor)
            self.actors = [actor_cls.options(
                num_cpus=1, num_gpus=1 if use_gpu else 0, runtime_env={"env_vars": {"PYTHONPATH": path}},
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=r),
            ).remote() for r in range(ws)]
            ip, port = ray.get(self.actors[0].address.remote())
            init = f"tcp://{ip}:{port}"
            self.pids = ray.get([a.init_worker.remote(config, model_folder, r, ws, init, 1)
                                 for r, a in enumerate(self.actors)])
        except BaseException:
            self._release()
            raise
        self._resolver.start()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                       non_block: bool = False) -> list[Any] | Future:
        fut: Future = Future()
        with self._cond:
            if method == "shutdown" and (self._error is not None or self._closed):
                # Failed or closed actors have nothing left to tear down; `shutdown()` kills them.
                fut.set_result([None] * self.world_size)
                return fut if non_block else fut.result()
            if self._error is not None:
                raise self._error
            if self._closed:
                raise WorkerError("executor is shut down")
            refs = [a.call.remote(method, args, kwargs or {}) for a in self.actors]
            self._pending.append(_Call(method, refs, fut))
            self._cond.notify_all()
        return fut if non_block else fut.result()

    def check_health(self) -> None:
        if self._error is not None:
            raise self._error

    def _resolve_loop(self) -> None:
        ray = self._ray
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                call = self._pending[0]
            remaining = list(call.refs)
            try:
                while remaining and not self._closed:
                    # One at a time so an error on any rank surfaces even while another rank waits in
                    # a collective that will never complete.
                    done, remaining = ray.wait(remaining, num_returns=1, timeout=0.5)
                    ray.get(done)
                if self._closed:
                    return
                results = ray.get(call.refs)
            except Exception as exc:  # RayTaskError (the worker raised) or RayActorError (it died)
                with self._cond:
                    self._fail(WorkerError(f"ray worker failed in {call.method}: {exc}"))
                continue
            with self._cond:
                if self._pending and self._pending[0] is call:
                    self._pending.popleft()
            if call.method in RANK0_ONLY:
                results = [r if i == self.output_rank else None for i, r in enumerate(results)]
            call.future.set_result(results)

    def _fail(self, error: WorkerError) -> None:
        """Fail every pending call (caller holds the lock)."""
        if self._error is None:
            self._error = error
            if not self._closed:
                logger.error("%s", error)
        pending, self._pending = list(self._pending), deque()
        for c in pending:
            if not c.future.done():
                c.future.set_exception(self._error)

    def _release(self) -> None:
        ray = self._ray
        from ray.util.placement_group import remove_placement_group
        for a in self.actors:
            ray.kill(a)
        self.actors = []
        remove_placement_group(self.pg)
        if self._owns_ray:
            ray.shutdown()

    def shutdown(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        if self._resolver.is_alive():
            self._resolver.join()
        with self._cond:
            self._fail(self._error or WorkerError("executor shut down"))
        self._release()

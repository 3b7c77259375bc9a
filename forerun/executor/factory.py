"""Picks the executor class for `--distributed-executor-backend`."""

from __future__ import annotations

from pathlib import Path

from forerun.config import EngineConfig
from forerun.executor.base import Executor


def make_executor(config: EngineConfig, model_folder: Path) -> Executor:
    if config.worker_extension_cls is not None:  # a clear error here, not one per worker process later
        from forerun.worker.extension import import_class
        import_class(config.worker_extension_cls)
    backend = config.distributed_executor_backend
    if backend == "uni":
        from forerun.executor.uni import UniExecutor
        return UniExecutor(config, model_folder)
    if backend == "mp":
        from forerun.executor.mp import MultiprocExecutor
        return MultiprocExecutor(config, model_folder)
    if backend == "external_launcher":
        from forerun.executor.external_launcher import ExternalLauncherExecutor
        return ExternalLauncherExecutor(config, model_folder)
    if backend == "ray":
        from forerun.executor.ray_executor import RayExecutor
        return RayExecutor(config, model_folder)
    raise ValueError(f"distributed_executor_backend: {backend!r} is not available in this build yet")

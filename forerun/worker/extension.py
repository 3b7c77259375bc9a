"""`worker_extension_cls`: a trainer's class mixed into every rank's worker (vLLM's meaning), and the
callables `collective_rpc` ships to workers in other processes."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

import cloudpickle


def import_class(qualname: str, field: str = "worker_extension_cls") -> type:
    """The class named `module.Class`; ValueError naming `field` when it cannot be imported."""
    module_name, _, class_name = qualname.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{field}: cannot import {qualname!r} ({exc})") from exc
    if not isinstance(found, type):
        raise ValueError(f"{field}: {qualname!r} is not a class")
    return found


def with_extension(base: type, qualname: str | None) -> type:
    """`base`, or a subclass of `base` and the extension class named `qualname`.

    A new subclass rather than editing `base.__bases__` (as vLLM does), so engines with different
    extensions in one process never see each other's methods. An extension that would replace one of
    the worker's own attributes is refused: the engine calls those, and a silent override breaks it.
    """
    if qualname is None:
        return base
    ext = import_class(qualname)
    clash = sorted(name for name in vars(ext) if not name.startswith("__") and hasattr(base, name))
    if clash:
        raise ValueError(f"worker_extension_cls: {qualname} defines {clash[0]!r}, which the worker already has; "
                         "rename it")
    return type(f"{base.__name__}With{ext.__name__}", (base, ext), {"__module__": base.__module__})


def pickle_callable(fn: Callable[..., Any]) -> bytes:
    """`fn` as bytes another process can run: cloudpickle carries lambdas and closures by value."""
    return cloudpickle.dumps(fn)


def unpickle_callable(blob: bytes) -> Callable[..., Any]:
    fn = cloudpickle.loads(blob)
    if not callable(fn):
        raise ValueError(f"collective_rpc: the shipped object is a {type(fn).__name__}, not a callable")
    return fn


@dataclass(frozen=True)
class RpcError:
    """A trainer call's exception, returned rather than raised so the worker (and, with worker
    processes, the executor) stays usable; the executor raises it on the caller's side."""

    type_name: str
    message: str
    value_error: bool

    def exception(self, method: str, rank: int) -> Exception:
        if self.value_error:  # the call's own message already names what is wrong
            return ValueError(self.message)
        return RuntimeError(f"collective_rpc {method!r} failed on rank {rank}: {self.type_name}: {self.message}")


def run_user_call(worker: Any, target: str | bytes | Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run a trainer's call on `worker`: a method name, or a callable (pickled when it crossed a process
    boundary) called as `fn(worker, *args, **kwargs)`. Its exception comes back as an RpcError."""
    try:
        if isinstance(target, bytes):
            target = unpickle_callable(target)
        if callable(target):
            return target(worker, *args, **kwargs)
        method = None if target.startswith("_") else getattr(worker, target, None)
        if not callable(method):
            raise ValueError(f"collective_rpc: the worker has no method {target!r} "
                             "(add it with worker_extension_cls, or pass a callable)")
        return method(*args, **kwargs)
    except Exception as exc:
        return RpcError(type(exc).__name__, str(exc), isinstance(exc, ValueError))

"""Start child interpreters: multiprocessing's 'spawn' without the user's main script run again, and
PythonChild, a fresh interpreter without multiprocessing."""

from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_MAIN_IDENTITY = ("__spec__", "__file__")


@contextmanager
def main_script_not_rerun() -> Iterator[None]:
    """Processes started with 'spawn' inside this block do not import the parent's `__main__`.

    'spawn' normally runs the parent's main script again in each child (as `__mp_main__`), so that
    objects defined there can be unpickled. forerun's children run only forerun code, so that buys
    nothing and costs two failures: a script that builds an engine without an
    `if __name__ == "__main__":` guard builds it again in every worker, which then dies trying to
    start workers of its own; and a script fed on stdin cannot be read again (`<stdin>` is no file).
    Forking instead is not safe either: a child forked after the parent ran a parallel torch op hangs
    in its first one (GNU OpenMP's thread pool does not survive fork).

    multiprocessing decides from the main module's `__spec__` and `__file__` while `Process.start()`
    runs, so both are hidden for that long and then put back.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {k: main.__dict__[k] for k in _MAIN_IDENTITY if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None  # read as `main.__spec__`, so it must exist
    try:
        yield
    finally:
        for k in _MAIN_IDENTITY:
            main.__dict__.pop(k, None)
        main.__dict__.update(saved)


# What a PythonChild runs: sys.path first (a plain list, so that the pickle after it can name modules
# found only on the parent's path), then the target and its arguments.
_CHILD_MAIN = ("import pickle, sys; sys.path[:] = pickle.load(sys.stdin.buffer); "
               "from forerun.executor.spawn import run_child; run_child()")


class PythonChild:
    """`target(*args)` in a fresh interpreter, with the calls of multiprocessing's Process that forerun
    uses (`pid`, `is_alive`, `join`, `exitcode`, `terminate`, `kill`).

    Why not multiprocessing: its 'spawn' also starts a resource-tracker process, 13 MB resident for the
    life of the server, to clean up shared memory and semaphores the child never makes (a core that
    starts worker processes starts its own tracker then). `target` must be importable by its module
    and name; the child gets the parent's sys.path, working directory and environment, and reads
    nothing from the parent's stdin.
    """

    def __init__(self, target: Callable[..., None], args: tuple[Any, ...]) -> None:
        self._popen = subprocess.Popen([sys.executable, "-c", _CHILD_MAIN], stdin=subprocess.PIPE)
        self.pid = self._popen.pid
        assert self._popen.stdin is not None
        try:
            with self._popen.stdin as pipe:
                pickle.dump(list(sys.path), pipe)
                pickle.dump((target.__module__, target.__qualname__, args), pipe)
        except BrokenPipeError:
            pass  # the child died at start: is_alive() and exitcode say so

    @property
    def exitcode(self) -> int | None:
        """None while running; the exit status, or minus the signal that ended it (as multiprocessing)."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self._popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()


def run_child() -> None:
    """The child's side of PythonChild: read the target, give stdin up, run it."""
    module, name, args = pickle.load(sys.stdin.buffer)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # as multiprocessing does: a child never reads the parent's terminal
    os.close(devnull)
    sys.stdin = open(0, closefd=False)
    getattr(importlib.import_module(module), name)(*args)

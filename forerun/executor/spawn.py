"""Start processes with the 'spawn' method without running the user's main script again in them."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

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

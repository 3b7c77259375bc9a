"""PythonChild: the engine core's process, a fresh interpreter started without multiprocessing."""

from __future__ import annotations

import importlib
import signal
import sys
import textwrap
import time

import pytest

from forerun.executor.spawn import PythonChild

TARGETS = textwrap.dedent("""
    import os, sys

    def record(path, value):
        # what the child saw: its argument, and an empty stdin
        with open(path, "w") as f:
            f.write(f"{value!r} {sys.stdin.read()!r}")

    def fail():
        raise RuntimeError("on purpose")

    def leave(code):
        os._exit(code)

    def wait():
        import time
        time.sleep(60)
""")


@pytest.fixture
def targets(tmp_path, monkeypatch):
    """A module found only on this process's sys.path, so the child finds it only through the path it is sent."""
    folder = tmp_path / "only_here"
    folder.mkdir()
    (folder / "child_targets.py").write_text(TARGETS)
    monkeypatch.syspath_prepend(str(folder))
    sys.modules.pop("child_targets", None)
    yield importlib.import_module("child_targets")
    sys.modules.pop("child_targets", None)


def test_runs_the_target_with_its_args_on_the_parents_path(targets, tmp_path):
    out = tmp_path / "seen.txt"
    child = PythonChild(targets.record, (str(out), {"a": [1, 2]}))
    child.join(60)
    assert child.exitcode == 0 and not child.is_alive()
    assert out.read_text() == "{'a': [1, 2]} ''"


@pytest.mark.parametrize(("name", "args", "code"), [("fail", (), 1), ("leave", (7,), 7)])
def test_exit_codes_as_multiprocessing(targets, name, args, code):
    child = PythonChild(getattr(targets, name), args)
    child.join(60)
    assert child.exitcode == code


def test_join_times_out_and_terminate_ends_it(targets):
    child = PythonChild(targets.wait, ())
    try:
        t = time.monotonic()
        child.join(0.5)
        assert child.is_alive() and child.exitcode is None and time.monotonic() - t < 5
    finally:
        child.terminate()
        child.join(30)
    assert child.exitcode == -signal.SIGTERM
    child.kill()  # a no-op once it has exited

"""An engine's start leaves no garbage for a collection in the middle of its steps; the processes
forerun owns (the engine core's, the workers') also freeze what the start left."""

from __future__ import annotations

import gc
import subprocess
import sys

from forerun.config import EngineConfig
from forerun.engine.core_proc import _build_core
from forerun.engine.llm import LLM

FRESH = """
import gc, sys
from forerun.heap import settle_start_garbage

class Node:
    def __init__(self):
        self.me = self

kept = [Node() for _ in range(100)]
for _ in range(1000):
    Node()  # a cycle nothing refers to: only the collector frees it
freeze = sys.argv[1] == "freeze"
settle_start_garbage(freeze=freeze)
tracked = {id(o) for o in gc.get_objects()}
print(gc.get_freeze_count() > 0, gc.collect(), id(kept[0]) in tracked)
"""


def _fresh(mode: str) -> list[str]:
    # A fresh interpreter: freezing this one would keep every later test's cyclic garbage for good.
    run = subprocess.run([sys.executable, "-c", FRESH, mode], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


def test_settle_collects_and_freezes_only_when_asked():
    assert _fresh("collect") == ["False", "0", "True"]  # collected, and what lives is still tracked
    assert _fresh("freeze") == ["True", "0", "False"]  # what lives moved out of the collector's reach


def test_an_engine_in_a_users_process_ends_its_start_with_a_full_collection(tiny_llama_dir, track_llm):
    full: list[int] = []

    def note(phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:
            full.append(info["collected"])

    frozen = gc.get_freeze_count()
    gc.collect()  # whatever ran before: no full collection of its own is due during the start
    gc.callbacks.append(note)
    try:
        track_llm(LLM(model=str(tiny_llama_dir), dtype="float32", show_progress=False))
        counts = gc.get_count()
    finally:
        gc.callbacks.remove(note)
    # A full collection ran, at the end of the start: no younger collection has run since it (the
    # third count), so the next full one is not due for a while. Without it none ran during the start.
    assert full and counts[2] == 0, (full, counts)
    assert gc.get_freeze_count() == frozen  # a user's process: nothing frozen


def test_worker_processes_freeze_their_start(tiny_llama_dir, track_llm):
    llm = track_llm(LLM(model=str(tiny_llama_dir), dtype="float32", show_progress=False,
                        distributed_executor_backend="mp", tensor_parallel_size=2))
    assert all(n > 0 for n in llm.collective_rpc(lambda worker: __import__("gc").get_freeze_count()))


def test_the_core_process_freezes_its_start(tiny_llama_dir):
    assert gc.get_freeze_count() == 0
    core = None
    try:
        # The core process's own builder, run here: it freezes the heap of the process it runs in.
        core = _build_core(EngineConfig(model=str(tiny_llama_dir), dtype="float32"), tiny_llama_dir)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        if core is not None:
            core.shutdown()

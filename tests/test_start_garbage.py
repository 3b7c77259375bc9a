"""Where forerun owns the process, an engine ends its start with a full collection, so that none falls
due in its first steps; the engine core's and the workers' processes also freeze what the start left.
A user's process is left alone."""

from __future__ import annotations

import gc
import subprocess
import sys

from forerun.bench.throughput import start_engine
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


def _full_collections_during(build):
    """What `build()` returns, the objects each full collection during it collected, and the
    collector's counts right after it."""
    full: list[int] = []

    def note(phase: str, info: dict) -> None:
        if phase == "stop" and info["generation"] == 2:
            full.append(info["collected"])

    gc.collect()  # whatever ran before: no full collection of its own falls due during the build
    gc.callbacks.append(note)
    try:
        built = build()
        return built, full, gc.get_count()
    finally:
        gc.callbacks.remove(note)


def test_a_benchmark_engine_ends_its_start_with_a_full_collection(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), dtype="float32")
    engine, full, counts = _full_collections_during(lambda: start_engine(config))
    try:
        # At the end of the start: no younger collection has run since it (the third count), so the
        # next full one is not due for a while. Without it none ran during the start.
        assert full and counts[2] == 0, (full, counts)
        assert gc.get_freeze_count() == 0  # a run builds engine after engine: collected, not frozen
    finally:
        engine.shutdown()


def test_an_engine_in_a_users_process_leaves_the_collector_alone(tiny_llama_dir, track_llm):
    _, full, _ = _full_collections_during(
        lambda: track_llm(LLM(model=str(tiny_llama_dir), dtype="float32", show_progress=False)))
    assert full == [] and gc.get_freeze_count() == 0


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

"""The mp executor leaves no worker process and no shared-memory segment behind: after a start the engine
refused once its workers were up, after a normal shutdown, and at interpreter exit without one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from forerun import LLM
from test_executors import live_children

REPO = Path(__file__).resolve().parents[1]
LEAK = "leaked shared_memory"
# Refused after the workers started: the KV cache (4 blocks of 16) cannot hold max_model_len 1024.
REFUSED = dict(tensor_parallel_size=2, max_model_len=1024, num_kv_blocks=4, dtype="float32", show_progress=False)


def run_script(body: str) -> subprocess.CompletedProcess:
    """Run `body` in a fresh interpreter (its resource tracker reports leaks when it exits)."""
    code = "from forerun import LLM, SamplingParams\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def test_refused_start_leaves_no_worker(tiny_llama_dir):
    # What is left is killed after the test by conftest's reaper, passed or failed.
    for _ in range(2):
        with pytest.raises(ValueError, match="^max_model_len: 1024 tokens do not fit in the KV cache"):
            LLM(model=str(tiny_llama_dir), **REFUSED)
    assert live_children() == []


def test_refused_start_leaks_no_shared_memory(tiny_llama_dir):
    proc = run_script(f"""
        import psutil
        for _ in range(2):
            try:
                LLM(model={str(tiny_llama_dir)!r}, **{REFUSED!r})
            except ValueError as exc:
                print("refused:", exc)
        kids = [c for c in psutil.Process().children(recursive=True)
                if "resource_tracker" not in " ".join(c.cmdline())]
        print("children:", len(kids))
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("refused: max_model_len") == 2, proc.stdout
    assert "children: 0" in proc.stdout
    assert LEAK not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("explicit_shutdown", [True, False], ids=["shutdown", "exit-without-shutdown"])
def test_normal_mp_run_leaks_no_shared_memory(tiny_llama_dir, explicit_shutdown):
    proc = run_script(f"""
        llm = LLM(model={str(tiny_llama_dir)!r}, tensor_parallel_size=2, num_kv_blocks=64, dtype="float32",
                  show_progress=False)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        out = llm.generate(["Hello", "The sea"], params, use_tqdm=False)
        print("tokens:", [len(o.outputs[0].token_ids) for o in out])
        if {explicit_shutdown!r}:
            llm.shutdown()
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tokens: [6, 6]" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    assert LEAK not in proc.stderr, proc.stderr[-3000:]

"""external_launcher: every torchrun rank runs its own engine and gets the same outputs as `uni`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import save_tiny_model
from forerun import LLM, SamplingParams
from forerun.config import EngineConfig
from forerun.executor.external_launcher import ExternalLauncherExecutor
from forerun.executor.mp import free_port

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["Hello", "The capital of France is a city that",
           "One two three four five six seven eight nine ten eleven twelve", "Why"]

# The end of every rank script (fp32: TP 2 sums in another order than TP 1, which changes bf16 tokens):
# a sync and then an async engine in one process (the second reuses the
# process group, which the engine leaves to the script) run `requests()`, and both outputs go to
# this rank's own file.
RUN_BOTH_MODES = textwrap.dedent("""
    result = {}
    for mode in ("sync", "async"):
        llm = LLM(model=model, distributed_executor_backend="external_launcher",
                  tensor_parallel_size=int(os.environ["WORLD_SIZE"]), async_scheduling=mode == "async",
                  dtype="float32", show_progress=False)
        prompts, params = requests()
        outs = llm.generate(prompts, params, use_tqdm=False)
        result[mode] = [list(o.outputs[0].token_ids) for o in outs]
        llm.shutdown()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(result, f)
""")

RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch.distributed as dist
    from forerun import LLM, SamplingParams
    model, out_dir, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    def requests():
        return prompts, SamplingParams(temperature=0.0, max_tokens=16)
""") + RUN_BOTH_MODES

# Structured requests whose grammars compile later on rank 1 than on rank 0 (a delay is injected
# there), mixed with plain ones that run meanwhile: each rank must still admit them at the same step.
STRUCTURED_RANK_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import torch.distributed as dist
    from forerun import LLM
    from forerun.structured.xgrammar_backend import XGrammarBackend
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from structured_requests import requests
    model, out_dir, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
    if os.environ["RANK"] == "1":
        compile_now = XGrammarBackend.compile
        def compile_late(self, key):
            time.sleep(delay)
            return compile_now(self, key)
        XGrammarBackend.compile = compile_late
""") + RUN_BOTH_MODES

STRUCTURED_REQUESTS = textwrap.dedent("""
    from forerun import SamplingParams
    from forerun.structured.spec import StructuredOutputsParams

    def requests():
        plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        specs = [StructuredOutputsParams(regex=r"[a-z]{3,8} [0-9]{2}"),
                 StructuredOutputsParams(choice=["alpha", "beta", "gamma"]),
                 StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}},
                                               "required": ["n"], "additionalProperties": False})]
        prompts = ["Hello", "The capital of France is", "One two three", "Why", "Name a number:", "Pick"]
        params = [plain, SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=specs[0]), plain,
                  SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=specs[1]), plain,
                  SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=specs[2])]
        return prompts, params
""")


def run_torchrun(script: Path, *args: str, timeout: float = 120) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(script), *args]
    # Own session, so a timeout can end the ranks too, not only torchrun.
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
    assert proc.returncode == 0, log[-4000:]
    return log


def assert_every_rank_matches(out_dir: Path, ref: list[list[int]]) -> None:
    for rank in (0, 1):
        result = json.loads((out_dir / f"rank{rank}.json").read_text())
        assert result["sync"] == ref, f"rank {rank} sync"
        assert result["async"] == ref, f"rank {rank} async"


@pytest.fixture(scope="module")
def varied_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    """tiny_llama_dir's shape with larger random weights, so greedy outputs are not one repeated token."""
    return save_tiny_model(tmp_path_factory.mktemp("varied-llama"), smollm2_dir, initializer_range=0.3)


def test_torchrun_tp2_matches_uni_sync_and_async(varied_llama_dir, tmp_path):
    with LLM(model=str(varied_llama_dir), distributed_executor_backend="uni", async_scheduling=False,
             dtype="float32", show_progress=False) as llm:
        ref = [list(o.outputs[0].token_ids)
               for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)]
    script = tmp_path / "rank_script.py"
    script.write_text(RANK_SCRIPT)
    run_torchrun(script, str(varied_llama_dir), str(tmp_path), json.dumps(PROMPTS))
    assert_every_rank_matches(tmp_path, ref)


def test_torchrun_tp2_structured_grammars_ready_at_different_times_on_each_rank(varied_llama_dir, tmp_path):
    (tmp_path / "structured_requests.py").write_text(STRUCTURED_REQUESTS)
    sys.path.insert(0, str(tmp_path))
    try:
        from structured_requests import requests
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("structured_requests", None)
    prompts, params = requests()
    with LLM(model=str(varied_llama_dir), distributed_executor_backend="uni", async_scheduling=False,
             dtype="float32", show_progress=False) as llm:
        ref = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(ref), "every request produced tokens"
    script = tmp_path / "rank_script.py"
    script.write_text(STRUCTURED_RANK_SCRIPT)
    run_torchrun(script, str(varied_llama_dir), str(tmp_path), "1.5", timeout=180)
    assert_every_rank_matches(tmp_path, ref)


def test_missing_launcher_environment_is_a_clear_error(monkeypatch, varied_llama_dir):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match="RANK"):
        ExternalLauncherExecutor(EngineConfig(tensor_parallel_size=2), varied_llama_dir)


def test_world_size_must_match_tensor_parallel_size(monkeypatch, varied_llama_dir):
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        ExternalLauncherExecutor(EngineConfig(tensor_parallel_size=4), varied_llama_dir)

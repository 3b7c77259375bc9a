"""uni / mp / ray executors: identical greedy outputs at TP 1 and 2, sync and async, real run-ahead with
TP, errors and worker deaths that surface quickly, and shutdowns that leave nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from conftest import save_tiny_model
from forerun import LLM, SamplingParams

PROMPTS = ["Hello", "The capital of France is a city that",
           "One two three four five six seven eight nine ten eleven twelve", "Why"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def varied_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    """tiny_llama_dir's shape (hidden 64, 4 heads, 2 KV heads) with larger random weights: the default
    init makes every prompt repeat one token, which would make output equality nearly vacuous."""
    return save_tiny_model(tmp_path_factory.mktemp("varied-llama"), smollm2_dir, initializer_range=0.3)


def make_llm(model: Path, backend: str, tp: int, async_: bool, dtype: str = "float32", **kw) -> LLM:
    """fp32 unless asked: TP 2 sums its partial matmuls in another order than TP 1, which changes tokens
    in bf16 (picked by `auto` on avx512_bf16 machines) but not in fp32 on these small models."""
    return LLM(model=str(model), distributed_executor_backend=backend, tensor_parallel_size=tp,
               async_scheduling=async_, show_progress=False, dtype=dtype, **kw)


@pytest.fixture
def open_llm(track_llm):
    """make_llm whose engines are shut down when the test ends, passed or failed."""
    return lambda *args, **kw: track_llm(make_llm(*args, **kw))


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def token_ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def forerun_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("forerun")]


def live_children() -> list[psutil.Process]:
    """Children of this test process, less multiprocessing's resource tracker (it lives as long as we do)."""
    out = []
    for c in psutil.Process().children(recursive=True):
        try:
            if c.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in " ".join(c.cmdline()):
                out.append(c)
        except psutil.NoSuchProcess:
            pass
    return out


def assert_clean() -> None:
    assert forerun_threads() == []
    assert live_children() == []


def assert_dead_engine_winds_down(llm: LLM, prompts: list[str]) -> None:
    """After a worker was killed: the surviving workers exit, new requests are refused, nothing is left."""
    deadline = time.monotonic() + 5
    while live_children() and time.monotonic() < deadline:  # the monitor ends the surviving workers
        time.sleep(0.1)
    assert live_children() == []
    with pytest.raises(RuntimeError, match="died"):
        llm.generate(prompts, greedy(), use_tqdm=False)
    llm.shutdown()
    assert_clean()


@pytest.fixture(scope="module")
def reference(varied_llama_dir) -> list[list[int]]:
    with make_llm(varied_llama_dir, "uni", 1, False) as llm:
        outs = token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False))
    assert len({tuple(t) for t in outs}) == len(PROMPTS)
    assert all(len(set(t)) > 4 for t in outs)  # not one repeated token
    return outs


def test_uni_async_matches_sync(varied_llama_dir, reference):
    with make_llm(varied_llama_dir, "uni", 1, True) as llm:
        assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == reference


# A user's script as it is often written: no `if __name__ == "__main__":` guard.
UNGUARDED_SCRIPT = """
import json
from forerun import LLM, SamplingParams
llm = LLM(model={model!r}, distributed_executor_backend="mp", dtype="float32", show_progress=False)
outs = llm.generate({prompts!r}, SamplingParams(temperature=0.0, max_tokens={max_tokens}), use_tqdm=False)
print("TOKENS", json.dumps([list(o.outputs[0].token_ids) for o in outs]))
llm.shutdown()
"""


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_mp_from_a_script_without_main_guard_or_fed_on_stdin(varied_llama_dir, reference, tmp_path, how):
    code = UNGUARDED_SCRIPT.format(model=str(varied_llama_dir), prompts=PROMPTS, max_tokens=MAX_TOKENS)
    repo = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    if how == "file":
        (tmp_path / "script.py").write_text(code)
        cmd, stdin = [sys.executable, str(tmp_path / "script.py")], None
    else:
        cmd, stdin = [sys.executable, "-"], code
    res = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("TOKENS ")]
    assert len(lines) == 1, "the script ran once: the worker did not run it again"
    assert json.loads(lines[0][len("TOKENS "):]) == reference


@pytest.mark.parametrize("tp,async_", [(1, False), (1, True), (2, False)])
def test_mp_matches_uni(varied_llama_dir, reference, tp, async_, open_llm):
    llm = open_llm(varied_llama_dir, "mp", tp, async_)
    assert len(live_children()) == tp
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == reference
    # A prompt cached whole computes only its last token, each rank copying its share of the last block.
    whole = [list(range(100, 132))]
    first = llm.generate(whole, greedy(), use_tqdm=False)
    again = llm.generate(whole, greedy(), use_tqdm=False)
    assert again[0].num_cached_tokens == 31 and token_ids(again) == token_ids(first)
    llm.shutdown()
    assert_clean()


def test_mp_tp2_bf16_async_matches_sync(varied_llama_dir, reference, open_llm):
    """In bf16 TP 2 may differ from TP 1 (another summation order), but the run-ahead must not change a
    token: async TP 2 equals sync TP 2, and both follow the fp32 reference for their first tokens."""
    outs = {}
    for async_ in (False, True):
        llm = open_llm(varied_llama_dir, "mp", 2, async_, dtype="bfloat16")
        outs[async_] = token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False))
        llm.shutdown()
    assert outs[True] == outs[False]
    assert [t[:2] for t in outs[True]] == [t[:2] for t in reference]


def test_mp_tp2_async_runs_ahead(varied_llama_dir, reference, open_llm):
    """Two batches really in flight with TP 2; max_tokens exact; an EOS-style stop costs one dead token."""
    llm = open_llm(varied_llama_dir, "mp", 2, True, trace=True)
    outs = llm.generate(PROMPTS, greedy(), use_tqdm=False)
    assert token_ids(outs) == reference
    assert all(len(t) == MAX_TOKENS for t in token_ids(outs))
    events = llm.engine.core.trace.events
    schedule = {e.step: e.begin for e in events if e.name == "schedule"}
    update = {e.step: e.begin for e in events if e.name == "update"}
    ahead = [s for s in update if s + 1 in schedule and schedule[s + 1] < update[s]]
    assert len(ahead) >= MAX_TOKENS - 2  # nearly every step was scheduled before its predecessor was applied
    assert llm.engine.core.trace.dead_tokens() == 0  # length stops never cost a dead token
    forwards = [e for e in events if e.name == "forward"]
    assert forwards and all(e.thread == "forerun-rank0" for e in forwards)

    stop_tok = reference[1][5]
    cut = reference[1].index(stop_tok)
    before = len(events)
    out = llm.generate([PROMPTS[1]], greedy(stop_token_ids=[stop_tok]), use_tqdm=False)[0]
    # The stop token ends the output exactly where it first comes, and is part of it.
    assert list(out.outputs[0].token_ids) == reference[1][:cut + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_tok
    while llm.engine.has_unfinished_requests():  # apply the step still in flight when generate returned
        llm.engine.step()
    new = events[before:]
    assert sum(len(e.args.get("dead_tokens", ())) for e in new) == 1
    llm.shutdown()
    assert_clean()


def test_mp_tp4_async_runs_ahead(tmp_path, smollm2_dir, reference, open_llm):
    """TP 4 (four worker processes): same tokens as one rank, and the run-ahead is intact."""
    folder = save_tiny_model(tmp_path / "tp4", smollm2_dir, initializer_range=0.3, num_key_value_heads=4)
    with make_llm(folder, "uni", 1, False) as llm:
        want = token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False))
    llm = open_llm(folder, "mp", 4, True, trace=True)
    assert len(live_children()) == 4
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == want
    events = llm.engine.core.trace.events
    schedule = {e.step: e.begin for e in events if e.name == "schedule"}
    update = {e.step: e.begin for e in events if e.name == "update"}
    ahead = [s for s in update if s + 1 in schedule and schedule[s + 1] < update[s]]
    assert len(ahead) >= MAX_TOKENS - 2
    llm.shutdown()
    assert_clean()


def test_mp_default_model(smollm2_dir):
    """SmolLM2-135M has 9 query and 3 KV heads: TP 2 cannot split it (a clear start-up error), TP 3 can."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 2 does not divide the model's num_attention_heads \(9\)"):
        make_llm(smollm2_dir, "mp", 2, True)
    assert_clean()  # refused before any worker started
    with make_llm(smollm2_dir, "uni", 1, False) as llm:
        ref = token_ids(llm.generate(prompts, greedy(8), use_tqdm=False))
    with make_llm(smollm2_dir, "mp", 3, True) as llm:
        assert token_ids(llm.generate(prompts, greedy(8), use_tqdm=False)) == ref
    assert_clean()


def test_mp_worker_killed_mid_generation(varied_llama_dir, open_llm):
    llm = open_llm(varied_llama_dir, "mp", 2, True)
    victim = llm.engine.core.executor.procs[1].pid
    killer = threading.Timer(1.0, os.kill, (victim, signal.SIGKILL))
    t0 = time.monotonic()
    killer.start()
    try:
        with pytest.raises(Exception, match=r"rank 1 .*died"):
            llm.generate(PROMPTS * 4, greedy(900, ignore_eos=True), use_tqdm=False)
    finally:
        killer.cancel()
    assert time.monotonic() - t0 < 11
    assert_dead_engine_winds_down(llm, PROMPTS)


def test_mp_worker_exception_reaches_caller(varied_llama_dir, open_llm):
    llm = open_llm(varied_llama_dir, "mp", 2, False)
    executor = llm.engine.core.executor
    assert len(set(executor.collective_rpc("ping"))) == 2  # two distinct worker pids
    with pytest.raises(RuntimeError, match="AttributeError"):
        executor.collective_rpc("no_such_method")
    with pytest.raises(RuntimeError):
        executor.check_health()
    llm.shutdown()
    assert_clean()


@pytest.fixture(scope="module")
def local_ray():
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.parametrize("async_,pp", [(False, 1), (True, 1), (True, 2)], ids=["sync", "async", "async-pp2"])
def test_ray_tp2_matches_uni(varied_llama_dir, reference, local_ray, async_, pp, open_llm):
    """TP 2, and TP 1 x PP 2 (two pipeline stages: the same two actors, wired as stages)."""
    llm = open_llm(varied_llama_dir, "ray", 2 // pp, async_, pipeline_parallel_size=pp)
    pids = llm.engine.core.executor.pids
    assert token_ids(llm.generate(PROMPTS, greedy(), use_tqdm=False)) == reference
    llm.shutdown()
    assert forerun_threads() == []
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids) \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)



def test_uni_worker_thread_runs_below_the_engine_thread(tiny_llama_dir):
    """On a CPU the model's thread (and the OpenMP threads it starts) run a step below the engine thread,
    so the engine thread is never preempted by them while it holds the GIL the worker waits for."""
    import torch

    from forerun.config import EngineConfig
    from forerun.engine.llm_engine import LLMEngine
    from forerun.platform import MODEL_THREAD_NICE

    def nice_here() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    engine_nice = nice_here()
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir)), show_progress=False)
    try:
        worker_nice = engine.core.executor._pool.submit(nice_here).result()
        threads = engine.core.executor._pool.submit(torch.get_num_threads).result()
        nices = [int(open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()[16])  # field 19
                 for tid in os.listdir("/proc/self/task")]
    finally:
        engine.shutdown()
    assert worker_nice == min(19, engine_nice + MODEL_THREAD_NICE)
    assert nice_here() == engine_nice  # the engine thread itself is left as it was
    if threads > 1:
        assert nices.count(worker_nice) >= 2, "the worker's OpenMP threads inherit it"

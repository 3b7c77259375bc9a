"""The `forerun` command, run as a user would: generate, chat, bench throughput with its timeline."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys


def forerun(*args: str, stdin: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "forerun.entrypoints.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout)


def test_generate_streams_the_default_model_answer():
    res = forerun("generate", "The capital of France is", "--max-tokens", "4")
    assert res.returncode == 0, res.stderr
    assert "Paris" in res.stdout and res.stdout.endswith("\n")  # flushed in full before the quick exit


def test_console_script_exits_normally_while_a_child_process_lives(monkeypatch):
    """The quick exit skips interpreter teardown; with a child process still running it must not, so
    that multiprocessing's exit handler still reaps it."""
    import multiprocessing
    import time

    import pytest

    from forerun.entrypoints import cli
    monkeypatch.setattr(cli, "main", lambda: 3)
    child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(30,), daemon=True)
    child.start()
    try:
        with pytest.raises(SystemExit) as exit_info:
            cli.run()
        assert exit_info.value.code == 3
    finally:
        child.kill()
        child.join()


def test_chat_keeps_the_conversation(tiny_llama_dir):
    res = forerun("chat", "--model", str(tiny_llama_dir), "--max-tokens", "3", stdin="hello\nand again\n\n")
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("> ") >= 3  # a prompt for each turn, and one for the empty line that ends it


def test_bad_flag_value_is_a_clear_error(tiny_llama_dir):
    res = forerun("generate", "x", "--model", str(tiny_llama_dir), "--block-size", "0")
    assert res.returncode == 2 and "block_size" in res.stderr


def test_bench_throughput_compare_async_writes_trace_and_plot(tmp_path, tiny_llama_dir):
    trace, plot, out = tmp_path / "t.json", tmp_path / "t.png", tmp_path / "r.json"
    res = forerun("bench", "throughput", "--model", str(tiny_llama_dir), "--num-prompts", "8", "--input-len", "16",
                  "--output-len", "8", "--vary-lengths", "--compare-async", "--trace", str(trace), "--plot", str(plot),
                  "--output-json", str(out))
    assert res.returncode == 0, res.stderr
    result = json.loads(out.read_text())
    for mode in ("sync", "async"):
        assert result[mode]["output_tokens"] > 0 and 0 < result[mode]["busy_fraction"] <= 1
        assert result[mode]["dead_tokens"] == 0  # ignore_eos: length stops never cost a dead token
        assert 0 < result[mode]["engine_cpu_ms_per_step"] < result[mode]["elapsed_s"] * 1000
        assert result[mode]["matmul_gflops"] > 0  # counted from the launched steps, kept only for a replay
    assert result["speedup_async_over_sync"] > 0
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["name"] for e in events}
    assert {"schedule", "forward", "sample", "update"} <= names
    assert plot.stat().st_size > 10_000


def test_serve_without_the_serve_extra_prints_the_install_command(monkeypatch, capsys):
    import pytest

    from forerun.entrypoints.cli import main
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # `import uvicorn` now fails as if not installed
    monkeypatch.delitem(sys.modules, "forerun.entrypoints.openai.api_server", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--port", "1"])
    message = str(exit_info.value.code)
    assert "pip install 'forerun[serve]'" in message and "uvicorn" in message


def test_bench_one_prompt_forward_only_and_profile(tmp_path, tiny_llama_dir):
    prof, out = tmp_path / "prof.json", tmp_path / "r.json"
    res = forerun("bench", "throughput", "--model", str(tiny_llama_dir), "--num-prompts", "1", "--input-len", "12",
                  "--output-len", "6", "--forward-only", "--repeat", "2", "--profile", str(prof),
                  "--output-json", str(out))
    assert res.returncode == 0, res.stderr
    result = json.loads(out.read_text())
    run = result["async"]
    assert run["output_tokens"] == 6 and run["matmul_gflops"] > 0 and 0 < run["fraction_of_matmul_peak"]
    assert run["busy_fraction"] is None  # no timeline unless asked for: the engine runs as a user runs it
    assert result["matmul_peak_gflops"] > 0 and result["forward_only"]["output_tok_per_s"] > 0
    # Each engine run is paired with the replay taken right after it; the share is the pairs' median.
    # (from unrounded throughputs: the reported ones are rounded to 0.01 tok/s)
    pairs, engine, replays = (run["over_forward_only_runs"], run["output_tok_per_s_runs"],
                              result["forward_only"]["output_tok_per_s_runs"])
    assert len(pairs) == len(engine) == len(replays) == 2
    for ratio, e, f in zip(pairs, engine, replays):
        assert abs(ratio - e / f) < 2e-3 * max(1.0, ratio)
    assert run["over_forward_only"] == round(statistics.median(pairs), 3) and run["over_forward_only_min"] == min(pairs)
    assert run["engine_share"] == round(1 - run["over_forward_only"], 3)
    top = json.loads(prof.read_text())
    assert top and all(set(row) == {"op", "self_ms", "calls"} for row in top)
    assert any("linear" in row["op"] or "mm" in row["op"] for row in top), "the worker thread's matmuls are seen"

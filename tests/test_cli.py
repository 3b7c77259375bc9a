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
    # One request: its first token, then 5 more at the time per token; together within the run's time.
    ttft, tpot = run["median_ttft_ms"], run["median_tpot_ms"]
    assert ttft > 0 and tpot > 0 and ttft + 5 * tpot <= 1000 * run["elapsed_s"] + 1
    assert abs(run["decode_tok_per_s"] - 1000 / tpot) < 0.01 * run["decode_tok_per_s"]
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


# ---- what a newcomer hit (issue #20) ----------------------------------------------------------------

def test_bad_log_level_is_one_line_before_or_after_the_subcommand():
    for argv in (["--log-level", "loud", "generate", "x"], ["generate", "x", "--log-level", "loud"]):
        res = forerun(*argv)
        assert res.returncode == 2, res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "--log-level" in lines[0] and "'loud'" in lines[0] and "debug" in lines[0], lines
    help_text = " ".join(forerun("generate", "--help").stdout.split())  # as wrapped for any terminal width
    assert "--log-level LEVEL" in help_text and "DEBUG, INFO, WARNING" in help_text


def test_log_level_after_the_subcommand_and_the_truncation_warning(tiny_llama_dir):
    from forerun.engine.tokenizer import Tokenizer
    prompt = "The capital of France is"
    num_prompt = len(Tokenizer.from_folder(tiny_llama_dir).encode(prompt))
    res = forerun("generate", prompt, "--model", str(tiny_llama_dir), "--dtype", "float32",
                  "--max-model-len", "16", "--max-tokens", "30", "--log-level", "info")
    assert res.returncode == 0, res.stderr
    assert "INFO forerun." in res.stderr  # the level given after the subcommand acts
    warnings = [line for line in res.stderr.splitlines() if line.startswith("forerun: warning:")]
    assert warnings == [f"forerun: warning: the prompt is {num_prompt} tokens and --max-tokens is 30, but "
                        f"max_model_len is 16: the answer stops after at most {16 - num_prompt} tokens"]
    # Without truncation there is no warning (and the default level logs no INFO line).
    res = forerun("generate", prompt, "--model", str(tiny_llama_dir), "--dtype", "float32", "--max-tokens", "3")
    assert res.returncode == 0 and "warning" not in res.stderr and "INFO" not in res.stderr, res.stderr


def test_config_errors_are_one_line_in_every_subcommand(tmp_path, smollm2_dir, tiny_llama_dir):
    from tests.conftest import save_tiny_model
    model = ["--model", str(tiny_llama_dir)]
    # the example: two tensor-parallel ranks cannot split 3 attention heads
    three_heads = ["--model", str(save_tiny_model(tmp_path / "three-heads", smollm2_dir, hidden_size=48,
                                                  num_attention_heads=3, num_key_value_heads=1)), "-tp", "2"]
    cases = {("generate", "x", *model, "--block-size", "0"): "block_size",
             ("chat", *model, "--block-size", "0"): "block_size",
             ("serve", *model, "--block-size", "0", "--port", "1"): "block_size",
             ("bench", "throughput", *model, "--block-size", "0"): "block_size",
             ("bench", "serve", "--num-prompts", "0"): "num_prompts",
             ("generate", "x", *three_heads): "tensor_parallel_size",
             ("chat", *three_heads): "tensor_parallel_size",
             ("serve", *three_heads, "--port", "0"): "tensor_parallel_size",
             ("bench", "throughput", "--num-prompts", "1", *three_heads): "tensor_parallel_size",
             # raised by the running engine (prompt too long), which must still shut down
             ("generate", "one two three four five six seven", *model, "--max-model-len", "4"): "prompt"}
    for argv, field_name in cases.items():
        res = forerun(*argv, stdin="")
        assert res.returncode == 2, (argv, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"forerun: error: {field_name}:"), (argv, res.stderr)


def test_an_interrupted_answer_is_aborted_in_the_engine(tiny_llama_dir):
    """What chat's Ctrl-C does inside: the request is aborted in the engine (not left running), the
    engine is idle with every KV block free, the text shown so far comes back, and the next turn runs."""
    import io

    from forerun.config import EngineConfig
    from forerun.engine.llm_engine import LLMEngine
    from forerun.entrypoints.cli import _Interrupt, _stream
    from forerun.sampling_params import SamplingParams

    class InterruptOnFirstWrite(io.StringIO):
        def __init__(self, interrupt: _Interrupt) -> None:
            super().__init__()
            self.interrupt = interrupt

        def write(self, text: str) -> int:
            self.interrupt.requested = True  # as the SIGINT handler does, between two engine steps
            return super().write(text)

    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32"), show_progress=False)
    try:
        free_before = engine.core.scheduler.kv.num_free_blocks
        interrupt = _Interrupt()
        out = InterruptOnFirstWrite(interrupt)
        text = _stream(engine, "hello there", SamplingParams(max_tokens=500, temperature=0.0), out, interrupt)
        assert text and out.getvalue() == text + "\n"
        assert len(engine.tokenizer.encode(text, add_special_tokens=False)) < 20  # stopped, not run to 500
        assert not engine.has_unfinished_requests()
        assert engine.core.scheduler.kv.num_free_blocks == free_before
        again = _stream(engine, "hello there", SamplingParams(max_tokens=4, temperature=0.0), io.StringIO())
        assert again.startswith(text)  # greedy: the same answer, now in full
    finally:
        engine.shutdown()


def _read_until(fd: int, buf: bytearray, done, timeout: float) -> bool:
    """Read the pty into `buf` until `done(buf)` or the timeout; True when `done`."""
    import os
    import select
    import time
    end = time.monotonic() + timeout
    while not done(buf):
        left = end - time.monotonic()
        if left <= 0:
            return False
        ready, _, _ = select.select([fd], [], [], min(left, 0.5))
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                return done(buf)
            if not chunk:
                return done(buf)
            buf += chunk
    return True


def test_chat_ctrl_c_stops_the_answer_and_a_second_at_the_prompt_quits(tiny_llama_dir):
    """In a terminal: Ctrl-C while the answer streams returns to the prompt, and the chat goes on; Ctrl-C
    at the prompt quits with status 0 and a final newline, so the shell's prompt gets its own line."""
    import os
    import pty
    import signal
    import time

    master, slave = pty.openpty()
    # As in a terminal, the chat starts with SIGINT's default action: a shell starts background jobs
    # (`pytest ... &`) with SIGINT ignored, children inherit that, and Python then installs no
    # KeyboardInterrupt handler, so Ctrl-C at the prompt would do nothing.
    proc = subprocess.Popen([sys.executable, "-m", "forerun.entrypoints.cli", "chat", "--model", str(tiny_llama_dir),
                             "--dtype", "float32", "--max-tokens", "900"],
                            stdin=slave, stdout=slave, stderr=slave, close_fds=True,  # input() prompts on stderr
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.close(slave)
    try:
        out = bytearray()
        assert _read_until(master, out, lambda b: b.endswith(b"> "), 240), bytes(out)
        for turn in (b"hello", b"and again"):
            os.write(master, turn + b"\n")
            start = len(out)
            # the echo of the line, then some of the answer (a 900-token answer takes seconds)
            assert _read_until(master, out, lambda b: len(b) - start > len(turn) + 40, 240), bytes(out)
            proc.send_signal(signal.SIGINT)
            assert _read_until(master, out, lambda b: b.endswith(b"> "), 60), bytes(out)
            answer = bytes(out[start:])
            assert len(answer) < 2000, answer  # stopped early: 900 tokens would be several thousand bytes
            assert proc.poll() is None
        # At the prompt: quit. A person is slower than input() going from writing "> " to reading the
        # terminal; a signal in between would only be seen at the next line typed (CPython's fgets loop).
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        _read_until(master, out, lambda b: False, 1)
        assert out.endswith(b"> \r\n"), bytes(out[-40:])
        assert b"Traceback" not in out and b"KeyboardInterrupt" not in out, bytes(out)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def test_bench_embed_prints_its_json():
    res = forerun("bench", "embed", "--num-texts", "4", "--max-tokens", "24", "--skip-hf")
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout)
    assert result["num_texts"] == 4 and result["forerun_sync"]["embeddings_per_s"] > 0
    assert result["max_abs_diff_async_vs_sync"] == 0.0

"""`forerun bench serve` against a real test server: every field of its JSON result is there and sane."""

from __future__ import annotations

import argparse
import json

import pytest

from forerun.bench.serve_bench import add_args, run
from serve_helpers import start_server, stop_server


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    srv = start_server(tiny_llama_dir, "--max-model-len", "256", "--num-kv-blocks", "128", api_key="bench-key")
    try:
        yield srv
    finally:
        code, left = stop_server(srv)
        assert not left


def test_bench_serve_json(server, tmp_path, capsys):
    out = tmp_path / "result.json"
    args = add_args(argparse.ArgumentParser()).parse_args([
        "--base-url", server.base_url, "--api-key", "bench-key", "--random-input-len", "16",
        "--random-output-len", "6", "--num-prompts", "12", "--request-rate", "50", "--max-concurrency", "6",
        "--ignore-eos", "--seed", "1", "--save-result", str(out), "--disable-tqdm"])
    result = run(args)
    assert "Serving Benchmark Result" in capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(result))
    assert saved["completed"] == 12 and saved["failures"] == 0
    assert saved["total_output_tokens"] == 12 * 6 and saved["total_input_tokens"] == 12 * 16
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "duration_s"):
        assert saved[key] > 0
    for metric in ("ttft", "tpot", "itl", "e2el"):
        stats = [saved[f"{s}_{metric}_ms"] for s in ("mean", "median", "p90", "p99")]
        assert all(v > 0 for v in stats), (metric, stats)
        assert saved[f"median_{metric}_ms"] <= saved[f"p99_{metric}_ms"]
    assert saved["mean_ttft_ms"] < saved["mean_e2el_ms"]
    for metric in ("ttft", "tpot"):
        assert saved[f"p50_{metric}_ms"] == saved[f"median_{metric}_ms"]
    # The longest gap of a stream is one of its gaps, so the worst stall bounds every gap statistic.
    assert 0 < saved["median_stall_ms"] <= saved["p99_stall_ms"] <= saved["max_stall_ms"]
    assert saved["max_stall_ms"] >= saved["p99_itl_ms"]


def test_bench_counts_failures(server):
    args = add_args(argparse.ArgumentParser()).parse_args([
        "--base-url", server.base_url, "--api-key", "wrong", "--model", "x", "--random-input-len", "4",
        "--random-output-len", "2", "--num-prompts", "3", "--disable-tqdm"])
    result = run(args)
    assert result["completed"] == 0 and result["failures"] == 3 and "HTTP 401" in result["errors"][0]

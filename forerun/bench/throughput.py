"""`forerun bench throughput`: offline throughput, sync vs async side by side, and a transformers baseline."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from forerun.bench.workloads import Workload, make_tiny_llama, random_workload, with_structured_ratio
from forerun.config import EngineConfig
from forerun.engine.llm_engine import LLMEngine
from forerun.engine.step_trace import StepTrace


def add_args(parser: argparse.ArgumentParser) -> None:
    from forerun.entrypoints.engine_args import add_engine_args
    add_engine_args(parser)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--vary-lengths", action="store_true", help="lengths uniform in [len/2, 3len/2]")
    parser.add_argument("--eos", action="store_true", help="let requests stop on EOS (default: ignore_eos)")
    parser.add_argument("--random-model", action="store_true",
                        help="a tiny random Llama with the default tokenizer (overhead-bound workload)")
    parser.add_argument("--random-hidden", type=int, default=256)
    parser.add_argument("--random-layers", type=int, default=4)
    parser.add_argument("--random-vocab", type=int, default=8192, help="LM-head width of the random model")
    parser.add_argument("--compare-async", action="store_true", help="run sync then async in this process")
    parser.add_argument("--structured-output-ratio", type=float, default=0.0,
                        help="share of requests constrained to a JSON schema")
    parser.add_argument("--compare-hf", action="store_true", help="also run transformers generate (static batches)")
    parser.add_argument("--trace", type=Path, help="write the step timeline (Chrome trace JSON)")
    parser.add_argument("--plot", type=Path, help="draw the sync/async step timelines (PNG)")
    parser.add_argument("--output-json", type=Path)


def run_mode(config: EngineConfig, workload: Workload, trace: bool = True) -> tuple[dict[str, Any], StepTrace | None]:
    """One engine, a short warm-up, then the whole workload timed."""
    config = dataclasses.replace(config, trace=trace)
    engine = LLMEngine(config, show_progress=False)
    try:
        # Warm-up: allocator, first-call costs, and the grammar compile (cached and shared afterwards).
        warm = [0, 1] + [i for i, p in enumerate(workload.params) if p.structured_outputs is not None][:1]
        _drain(engine, [workload.prompts[i] for i in warm], [workload.params[i] for i in warm])
        if engine.trace is not None:
            engine.trace.events.clear()
        steps0 = engine.core.scheduler.step_id
        start = time.perf_counter()
        out_tokens = _drain(engine, workload.prompts, workload.params)
        elapsed = time.perf_counter() - start
        t = engine.trace
        result = {
            "async_scheduling": bool(config.async_scheduling),
            "elapsed_s": round(elapsed, 3),
            "requests_per_s": round(len(workload.prompts) / elapsed, 3),
            "output_tok_per_s": round(out_tokens / elapsed, 2),
            "total_tok_per_s": round((out_tokens + workload.num_prompt_tokens) / elapsed, 2),
            "output_tokens": out_tokens,
            "steps": engine.core.scheduler.step_id - steps0,
            "busy_fraction": round(t.busy_fraction(), 4) if t else None,
            "dead_tokens": t.dead_tokens() if t else None,
            "preemptions": engine.core.scheduler.num_preemptions,
        }
        return result, t
    finally:
        engine.shutdown()
        gc.collect()


def _drain(engine: LLMEngine, prompts, params) -> int:
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    out_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                out_tokens += sum(len(c.token_ids) for c in out.outputs)
    return out_tokens


def hf_generate_baseline(folder: Path, workload: Workload, batch_size: int) -> dict[str, Any]:
    """transformers `generate` with static batches (left padding), greedy, each request to its max_tokens."""
    import torch
    import transformers as tf
    model = tf.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    out_tokens, start = 0, time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(workload.prompts), batch_size):
            chunk = workload.prompts[i:i + batch_size]
            n_new = max(p.max_tokens for p in workload.params[i:i + batch_size])
            width = max(len(p) for p in chunk)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                                 do_sample=False, pad_token_id=0)
            out_tokens += (gen.shape[1] - width) * len(chunk)
    elapsed = time.perf_counter() - start
    return {"elapsed_s": round(elapsed, 3), "output_tok_per_s": round(out_tokens / elapsed, 2),
            "requests_per_s": round(len(workload.prompts) / elapsed, 3), "batch_size": batch_size}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from forerun.entrypoints.engine_args import engine_config_from_args
    from forerun.model.model_source import resolve_model
    config = engine_config_from_args(args)
    tmp = None
    if args.random_model:
        tmp = tempfile.TemporaryDirectory(prefix="forerun-bench-")
        folder = make_tiny_llama(Path(tmp.name), resolve_model(config.model, show_progress=False),
                                 args.random_hidden, args.random_layers, vocab=args.random_vocab)
        config = dataclasses.replace(config, model=str(folder))
    folder = resolve_model(config.model)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    workload = random_workload(vocab, args.num_prompts, args.input_len, args.output_len, args.vary_lengths,
                               ignore_eos=not args.eos, seed=config.seed)
    if args.structured_output_ratio:
        workload = with_structured_ratio(workload, args.structured_output_ratio, config.seed)
    result: dict[str, Any] = {"model": str(config.model or "default"), "num_prompts": args.num_prompts,
                              "input_len": args.input_len, "output_len": args.output_len,
                              "vary_lengths": args.vary_lengths, "eos": args.eos,
                              "structured_output_ratio": args.structured_output_ratio}
    traces: dict[str, StepTrace] = {}
    modes = [False, True] if args.compare_async else [config.async_scheduling]
    for mode in modes:
        cfg = dataclasses.replace(config, async_scheduling=mode)
        name = "async" if cfg.async_scheduling or (mode is None and cfg.runner == "generate") else "sync"
        result[name], trace = run_mode(cfg, workload)
        if trace is not None:
            traces[name] = trace
    if "sync" in result and "async" in result:
        result["speedup_async_over_sync"] = round(result["async"]["output_tok_per_s"]
                                                  / result["sync"]["output_tok_per_s"], 3)
    if args.compare_hf:
        result["transformers"] = hf_generate_baseline(folder, workload, min(args.num_prompts, config.max_num_seqs))
        best = max(result[m]["output_tok_per_s"] for m in ("sync", "async") if m in result)
        result["ratio_vs_transformers"] = round(best / result["transformers"]["output_tok_per_s"], 3)
    if args.trace:
        from forerun.bench.timeline import write_chrome_trace
        write_chrome_trace(traces, args.trace)
    if args.plot:
        from forerun.bench.timeline import plot_timelines
        plot_timelines(traces, args.plot)
    if tmp is not None:
        tmp.cleanup()
    text = json.dumps(result, indent=2)
    print(text)
    if args.output_json:
        args.output_json.write_text(text)
    return result

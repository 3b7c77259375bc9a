"""`forerun bench throughput`: offline throughput, sync vs async side by side, and a transformers baseline."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from forerun.bench.forward_only import StepRecord, matmul_flops, record_steps, replay
from forerun.bench.workloads import (Workload, grounded_workload, make_tiny_llama, random_workload,
                                     with_structured_ratio)
from forerun.config import EngineConfig
from forerun.core.spec_stats import SpecDecodeStats
from forerun.core.scheduler_output import SchedulerOutput
from forerun.engine.llm_engine import LLMEngine
from forerun.engine.step_trace import StepTrace
from forerun.heap import settle_start_garbage
from forerun.sampling_params import SamplingParams, final_only


def add_args(parser: argparse.ArgumentParser) -> None:
    from forerun.entrypoints.engine_args import add_engine_args
    add_engine_args(parser)
    parser.add_argument("--num-prompts", type=int, default=64,
                        help="number of requests, all submitted at the start (default: %(default)s)")
    parser.add_argument("--input-len", type=int, default=128,
                        help="prompt length of each request in tokens, random ids (default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=128,
                        help="tokens generated for each request (its max_tokens) (default: %(default)s)")
    parser.add_argument("--vary-lengths", action="store_true",
                        help="draw each request's input and output length uniformly from [len/2, 3len/2] "
                             "(default: off: every request has exactly --input-len and --output-len)")
    parser.add_argument("--eos", action="store_true",
                        help="let requests stop at the end-of-sequence token (default: off: ignore_eos, so each "
                             "generates --output-len tokens)")
    parser.add_argument("--random-model", action="store_true",
                        help="benchmark a tiny random Llama that uses --model's tokenizer (an overhead-bound "
                             "workload) (default: off: --model itself)")
    parser.add_argument("--random-hidden", type=int, default=256,
                        help="hidden size of the --random-model (default: %(default)s)")
    parser.add_argument("--random-layers", type=int, default=4,
                        help="decoder layers of the --random-model (default: %(default)s)")
    parser.add_argument("--random-vocab", type=int, default=8192,
                        help="LM-head width (vocabulary) of the --random-model (default: %(default)s)")
    parser.add_argument("--compare-async", action="store_true",
                        help="run with async scheduling off, then on, in this process (default: off: one run, "
                             "as --async-scheduling says)")
    parser.add_argument("--workload", choices=["random", "grounded"], default="random",
                        help="random token prompts, or chat prompts asking the model to repeat or lightly edit "
                             "a passage of 200+ tokens (input-grounded: where n-gram speculation pays; "
                             "--input-len is then ignored, and requests stop at EOS or --output-len) "
                             "(default: %(default)s)")
    parser.add_argument("--compare-spec", action="store_true",
                        help="run without, then with --speculative-config, in this process (default: off)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each mode this many times, interleaved; tok/s reported as min and median "
                             "(default: %(default)s)")
    parser.add_argument("--structured-output-ratio", type=float, default=0.0,
                        help="share of requests, from 0 to 1, constrained to a JSON schema; they stop when the "
                             "JSON closes (default: %(default)s)")
    parser.add_argument("--compare-hf", action="store_true",
                        help="also run transformers generate in static batches of up to --max-num-seqs "
                             "requests (default: off)")
    parser.add_argument("--forward-only", action="store_true",
                        help="also replay the same steps with no engine (forward + sample only) and report "
                             "the engine's share of the time (default: off)")
    parser.add_argument("--profile", type=Path,
                        help="profile a forward-only replay on the worker and write the top operators to this "
                             "JSON file (default: no profile)")
    parser.add_argument("--trace", type=Path,
                        help="write the step timeline to this file, as Chrome trace JSON (default: none)")
    parser.add_argument("--plot", type=Path,
                        help="draw the sync/async step timelines to this PNG file (default: none)")
    parser.add_argument("--output-json", type=Path,
                        help="also write the result JSON to this file (default: printed only)")


@dataclasses.dataclass
class ModeRun:
    """One timed engine run: its figures, its timeline and the steps it launched (for a replay)."""

    result: dict[str, Any]
    trace: StepTrace | None
    record: StepRecord
    matmul_peak_gflops: float
    replay_s: float | None = None  # the same steps replayed forward-only on the same executor right after


def _warm_up(engine: LLMEngine, workload: Workload) -> None:
    """Allocator, first-call costs, the grammar compile (cached and shared afterwards), the KV cache's
    pages (untouched, the timed run would pay their first-use faults, a few % of a 55 M run) and the
    matmul kernels of every decode batch size (Worker.warm_matmuls): the timed run would pay each once
    and a forward-only replay on the same executor would not.

    The heap is warmed with the timed run's largest steps: two token budgets of the workload's prompts
    reversed (the same lengths, and no prefix-cache hits for the timed prompts), which run as a chunk
    of prefill alone and then one beside the first decodes, as the timed run starts. Their activations
    are the process's peak, and the first steps of those sizes pay for growing the heap, which the
    replay after the run would not (55 M shape: the run's first prefill chunk took 105-165 ms longer
    than in its replay, the second 25-45 ms)."""
    engine.core.executor.collective_rpc("touch_kv_cache")
    engine.core.executor.collective_rpc("warm_matmuls", (engine.config.max_num_seqs,))
    n = len(workload.prompts)
    warm = sorted({0, min(1, n - 1)}) + [i for i, p in enumerate(workload.params)
                                         if p.structured_outputs is not None][:1]
    _drain(engine, [workload.prompts[i] for i in warm], [workload.params[i] for i in warm])
    chunk: list[list[int]] = []
    tokens = 0
    while len(chunk) < n and tokens < 2 * engine.config.max_num_batched_tokens:
        chunk.append(workload.prompts[len(chunk)][::-1])
        tokens += len(chunk[-1])
    _drain(engine, chunk, [SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)] * len(chunk))


def start_engine(config: EngineConfig) -> LLMEngine:
    """An engine whose start ends with a full garbage collection (collected, not frozen: a run builds
    several engines in turn), so that none falls due in its timed steps (forerun.heap)."""
    engine = LLMEngine(config, show_progress=False)
    settle_start_garbage()
    return engine


def run_mode(config: EngineConfig, workload: Workload, trace: bool = True, keep_steps: bool = False,
             replay_after: bool = False) -> ModeRun:
    """One engine, a short warm-up, then the whole workload timed (with `keep_steps`, every step it
    launched, for a replay; with `trace`, its step timeline, which costs both threads a little).

    With `replay_after`, the launched steps are then replayed forward-only on the same executor: the
    same worker thread, OpenMP pool and memory, seconds after the engine run, so the pair differs only
    by the engine's own work (separate engines differ by where their memory landed, and these machines
    drift between runs a minute apart). The replay adds requests the worker already holds; it starts
    those rows over, as after a preemption."""
    config = dataclasses.replace(config, trace=trace)
    engine = start_engine(config)
    try:
        _warm_up(engine, workload)
        if engine.trace is not None:
            engine.trace.events.clear()
        steps0, dead0 = engine.core.scheduler.step_id, engine.core.scheduler.num_dead_tokens
        spec0 = dataclasses.replace(engine.core.scheduler.spec_stats)
        record = record_steps(engine, keep_steps)
        start, cpu_start = time.perf_counter(), time.thread_time()
        latencies: list[tuple[float, float]] = []
        out_tokens = _drain(engine, workload.prompts, workload.params, latencies)
        elapsed, engine_cpu = time.perf_counter() - start, time.thread_time() - cpu_start
        steps = engine.core.scheduler.step_id - steps0
        t = engine.trace
        result = {
            "async_scheduling": bool(config.async_scheduling),
            "elapsed_s": round(elapsed, 3),
            "requests_per_s": round(len(workload.prompts) / elapsed, 3),
            "output_tok_per_s": round(out_tokens / elapsed, 2),
            "total_tok_per_s": round((out_tokens + workload.num_prompt_tokens) / elapsed, 2),
            "output_tokens": out_tokens,
            "steps": steps,
            # This thread runs the engine (scheduling, applying outputs, text); on a CPU its time is taken
            # from the model's cores, so it is what the engine's share is made of.
            "engine_cpu_ms_per_step": round(1000 * engine_cpu / max(1, steps), 3),
            "busy_fraction": round(t.busy_fraction(), 4) if t else None,  # needs --trace or --plot
            "dead_tokens": engine.core.scheduler.num_dead_tokens - dead0,
            "preemptions": engine.core.scheduler.num_preemptions,
            **_latency_figures(latencies),
        }
        if config.speculative_config is not None:
            result["spec_decode"] = _spec_figures(spec0, engine.core.scheduler.spec_stats, result["steps"])
        replay_s = replay(engine, record.steps) if replay_after else None
        peak = engine.core.executor.collective_rpc("matmul_peak_gflops")[0]
        return ModeRun(result, t, record, peak, replay_s)
    finally:
        engine.shutdown()
        gc.collect()


def _spec_figures(before: SpecDecodeStats, after: SpecDecodeStats, steps: int) -> dict[str, Any]:
    drafts = after.num_drafts - before.num_drafts
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return {"acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else 0.0,
            "draft_tokens_per_step": round(drafted / steps, 3) if steps else 0.0,
            "num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted}


def run_forward_only(config: EngineConfig, workload: Workload, steps: list[SchedulerOutput],
                     profile: bool = False) -> tuple[float, list[dict] | None]:
    """Seconds to replay `steps` on a fresh engine's executor after the same warm-up (and, with
    `profile`, the worker's top operators during that replay)."""
    engine = start_engine(dataclasses.replace(config, trace=False))
    try:
        _warm_up(engine, workload)
        if profile:
            engine.core.executor.collective_rpc("start_profile")
        seconds = replay(engine, steps)
        top = engine.core.executor.collective_rpc("stop_profile")[0] if profile else None
        return seconds, top
    finally:
        engine.shutdown()
        gc.collect()


def _drain(engine: LLMEngine, prompts, params, latencies: list[tuple[float, float]] | None = None) -> int:
    """Run the requests to the end; the output tokens they made. `latencies` gets each finished
    request's time to its first token and its time per output token after that, in seconds."""
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    out_tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                n = sum(len(c.token_ids) for c in out.outputs)
                out_tokens += n
                m = out.metrics
                if latencies is not None and n > 1 and "ttft" in m:
                    latencies.append((m["ttft"], (m["e2e"] - m["ttft"]) / (n - 1)))
    return out_tokens


def _latency_figures(latencies: list[tuple[float, float]]) -> dict[str, float | None]:
    """Median time to first token and time per output token after it, in ms, and the decode rate one
    request sees (1000 / TPOT): the figure to set beside `llama-bench -p 0 -n N`, which times only
    decoding (forerun's output_tok_per_s counts the prompt's prefill in its time)."""
    if not latencies:
        return {"median_ttft_ms": None, "median_tpot_ms": None, "decode_tok_per_s": None}
    ttft = statistics.median(t for t, _ in latencies) * 1000
    tpot = statistics.median(t for _, t in latencies) * 1000
    return {"median_ttft_ms": round(ttft, 2), "median_tpot_ms": round(tpot, 3),
            "decode_tok_per_s": round(1000 / tpot, 2) if tpot > 0 else None}


def _modes(config: EngineConfig, args: argparse.Namespace) -> list[tuple[str, EngineConfig]]:
    """(name, config) per mode: sync/async with --compare-async, each without and with speculation with
    --compare-spec (names sync, async, sync_spec, async_spec)."""
    asyncs = [False, True] if args.compare_async else [config.async_scheduling]
    specs = [None, config.speculative_config] if args.compare_spec else [config.speculative_config]
    out = []
    for mode in asyncs:
        base = "async" if mode or (mode is None and config.runner == "generate") else "sync"
        for spec in specs:
            cfg = dataclasses.replace(config, async_scheduling=mode, speculative_config=spec)
            out.append((base + ("_spec" if spec is not None and args.compare_spec else ""), cfg))
    return out


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
    from forerun.loader.model_source import resolve_model
    from forerun.model.registry import model_matmul_shapes
    config = engine_config_from_args(args)
    tmp = None
    if args.random_model:
        tmp = tempfile.TemporaryDirectory(prefix="forerun-bench-")
        folder = make_tiny_llama(Path(tmp.name), resolve_model(config.model, show_progress=False),
                                 args.random_hidden, args.random_layers, vocab=args.random_vocab)
        config = dataclasses.replace(config, model=str(folder))
    folder = resolve_model(config.model)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    if args.workload == "grounded":
        from forerun.engine.tokenizer import Tokenizer
        workload = grounded_workload(Tokenizer.from_folder(folder), args.num_prompts, args.output_len)
    else:
        workload = random_workload(vocab, args.num_prompts, args.input_len, args.output_len, args.vary_lengths,
                                   ignore_eos=not args.eos, seed=config.seed)
    if args.structured_output_ratio:
        workload = with_structured_ratio(workload, args.structured_output_ratio, config.seed)
    # Offline, as `LLM.generate` runs it (and vLLM's throughput bench, through its LLM.generate): one
    # output per request, at the end.
    workload = Workload(workload.prompts, final_only(workload.params))
    result: dict[str, Any] = {"model": str(config.model or "default"), "num_prompts": args.num_prompts,
                              "workload": args.workload, "input_len": args.input_len, "output_len": args.output_len,
                              "vary_lengths": args.vary_lengths, "eos": args.eos,
                              "structured_output_ratio": args.structured_output_ratio,
                              "speculative_config": dataclasses.asdict(config.spec) if config.spec else None}
    if args.compare_spec and config.spec is None:
        raise ValueError("compare_spec: needs --speculative-config")
    if args.repeat < 1:
        raise ValueError(f"repeat: must be >= 1, got {args.repeat}")
    traces: dict[str, StepTrace] = {}
    shapes = model_matmul_shapes(json.loads((folder / "config.json").read_text()))
    runs: dict[str, ModeRun] = {}
    all_runs: dict[str, list[dict[str, Any]]] = {}
    replays: list[float] = []  # forward-only seconds, one per run of the first mode
    # Repeats are interleaved (A B A B ...), so load that drifts over time hits every mode alike; with
    # --forward-only each run of the first mode is followed by its replay, and the engine's share is
    # taken per adjacent pair (these machines drift by up to 2x within minutes).
    for _ in range(args.repeat):
        for i, (name, cfg) in enumerate(_modes(config, args)):
            # The timeline only when asked for: users run without it, and the replay runs without it.
            run = run_mode(cfg, workload, trace=bool(args.trace or args.plot),
                           keep_steps=i == 0 and (args.forward_only or bool(args.profile)),
                           replay_after=i == 0 and args.forward_only)
            flops = matmul_flops(run.record.scheduled_tokens, run.result["output_tokens"], shapes)
            gflops = flops / run.result["elapsed_s"] / 1e9
            run.result["matmul_gflops"] = _sig(gflops)
            run.result["fraction_of_matmul_peak"] = _sig(gflops / run.matmul_peak_gflops)
            if run.replay_s is not None:
                seconds = run.replay_s
                replays.append(seconds)
                # tok/s over replay tok/s (elapsed_s is rounded to 1 ms, too coarse for a tiny run)
                run.result["over_forward_only"] = round(
                    run.result["output_tok_per_s"] * seconds / run.result["output_tokens"], 3)
            all_runs.setdefault(name, []).append(run.result)
            if name not in runs or run.result["output_tok_per_s"] > runs[name].result["output_tok_per_s"]:
                runs[name] = run
            if run.trace is not None and name not in traces:
                traces[name] = run.trace
    for name, results in all_runs.items():
        tps = sorted(r["output_tok_per_s"] for r in results)
        # The same dict as the run's: figures added below (forward-only ratios) land in the JSON too.
        runs[name].result.update(output_tok_per_s_min=tps[0], output_tok_per_s_median=round(statistics.median(tps), 2),
                                 output_tok_per_s_runs=[r["output_tok_per_s"] for r in results])
        result[name] = runs[name].result
    first = next(iter(runs.values()))
    result["matmul_peak_gflops"] = _sig(first.matmul_peak_gflops)
    if args.forward_only:
        seconds = statistics.median(replays)
        fwd_tps = first.result["output_tokens"] / seconds
        result["forward_only"] = {
            "elapsed_s": round(seconds, 3), "output_tok_per_s": round(fwd_tps, 2),
            "output_tok_per_s_runs": [round(first.result["output_tokens"] / r, 2) for r in replays],
            "matmul_gflops": _sig(matmul_flops(first.record.scheduled_tokens, first.result["output_tokens"], shapes)
                                  / seconds / 1e9)}
        first_name = next(iter(all_runs))
        for name, run in runs.items():
            if name == first_name:  # each run over its own replay, taken right after it
                pairs = [r["over_forward_only"] for r in all_runs[name]]
                ratio = statistics.median(pairs)
                run.result.update(over_forward_only_min=min(pairs), over_forward_only_runs=pairs)
            else:  # other modes: over the median replay
                ratio = run.result["output_tok_per_s"] / fwd_tps
            run.result["over_forward_only"] = round(ratio, 3)
            run.result["engine_share"] = round(1.0 - ratio, 3)
    if args.profile:
        _, top = run_forward_only(config, workload, first.record.steps, profile=True)
        args.profile.write_text(json.dumps(top, indent=1))
        result["profile_top"] = top[:10] if top else None
    if "sync" in result and "async" in result:
        result["speedup_async_over_sync"] = round(result["async"]["output_tok_per_s_median"]
                                                  / result["sync"]["output_tok_per_s_median"], 3)
    for base in ("sync", "async"):
        if base in result and f"{base}_spec" in result:
            result[f"speedup_spec_over_no_spec_{base}"] = round(
                result[f"{base}_spec"]["output_tok_per_s_median"] / result[base]["output_tok_per_s_median"], 3)
    if args.compare_hf:
        result["transformers"] = hf_generate_baseline(folder, workload, min(args.num_prompts, config.max_num_seqs))
        best = max(result[m]["output_tok_per_s"] for m in runs)
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


def _sig(x: float) -> float:
    """Three significant digits: a tiny model's GFLOPS (0.04) must not round to zero."""
    return float(f"{x:.3g}")

"""The `forerun` command: generate, chat, serve, bench."""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import sys

from forerun.entrypoints.engine_args import add_engine_args, engine_config_from_args


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _sampling_params(args: argparse.Namespace):
    from forerun.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.sampling_seed, stop=args.stop)


def _stream(engine, prompt, params, out=sys.stdout) -> str:
    """Run one request to completion, writing text to `out` as it arrives."""
    engine.add_request(prompt, params)
    text = ""
    while engine.has_unfinished_requests():
        for ro in engine.step():
            delta = ro.outputs[0].delta_text
            if delta:
                out.write(delta)
                out.flush()
            if ro.finished:
                text = ro.outputs[0].text
                if ro.outputs[0].error:
                    raise RuntimeError(ro.outputs[0].error)
    out.write("\n")
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    from forerun.engine.llm_engine import LLMEngine
    engine = LLMEngine(engine_config_from_args(args))
    try:
        prompt = args.prompt
        if args.chat:
            text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            prompt = engine.tokenizer.encode(text, add_special_tokens=False)
        _stream(engine, prompt, _sampling_params(args))
    finally:
        engine.shutdown()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from forerun.engine.llm_engine import LLMEngine
    engine = LLMEngine(engine_config_from_args(args))
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    try:
        print("forerun chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except EOFError:
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            text = engine.tokenizer.apply_chat_template(messages)
            reply = _stream(engine, engine.tokenizer.encode(text, add_special_tokens=False), _sampling_params(args))
            messages.append({"role": "assistant", "content": reply})
    finally:
        engine.shutdown()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from forerun.entrypoints.serve import run_serve
    return run_serve(args) or 0


def cmd_bench_throughput(args: argparse.Namespace) -> int:
    from forerun.bench.throughput import run
    run(args)
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from forerun.bench.serve_bench import run
    run(args)
    return 0


def cmd_bench_embed(args: argparse.Namespace) -> int:
    from forerun.bench.embed_bench import run
    run(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="forerun", description="An LLM serving engine that schedules one step ahead.")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete one prompt, streaming tokens to the terminal")
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
    add_engine_args(p)
    _add_sampling_args(p)
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat that keeps the conversation")
    p.add_argument("--system", default=None, help="system message")
    add_engine_args(p)
    _add_sampling_args(p)
    p.set_defaults(fn=cmd_chat)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    from forerun.entrypoints.serve import add_serve_args
    add_serve_args(p)
    p.set_defaults(fn=cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks that print JSON").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("throughput", help="offline throughput; --compare-async for sync vs async")
    from forerun.bench.throughput import add_args as add_throughput_args
    add_throughput_args(p)
    p.set_defaults(fn=cmd_bench_throughput)
    p = bench.add_parser("serve", help="latency and throughput against an OpenAI-compatible server")
    from forerun.bench.serve_bench import add_args as add_serve_bench_args
    add_serve_bench_args(p)
    p.set_defaults(fn=cmd_bench_serve)
    p = bench.add_parser("embed", help="embeddings per second, forerun vs transformers")
    from forerun.bench.embed_bench import add_args as add_embed_bench_args
    add_embed_bench_args(p)
    p.set_defaults(fn=cmd_bench_embed)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def run() -> None:
    """The `forerun` console script: `main`, then a quick exit when nothing is left to clean up.

    Tearing down an interpreter that imported torch takes about 0.8 s on these machines, a sixth of a
    warm `forerun generate`. By the time `main` returns every command has shut its engine down and
    closed its files; when no child process or Ray session is left (their exit handlers would still
    have work), output is flushed and the process ends without the teardown.
    """
    code = main()
    ray = sys.modules.get("ray")
    if multiprocessing.active_children() or (ray is not None and ray.is_initialized()):
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that already left (`| head`), or a closed stream
            pass
    os._exit(code)


if __name__ == "__main__":
    run()

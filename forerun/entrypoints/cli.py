"""The `forerun` command: generate, chat, serve, bench."""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import TextIO

from forerun.entrypoints.engine_args import add_engine_args, engine_config_from_args

logger = logging.getLogger(__name__)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_LOG_LEVEL_HELP = "what forerun logs to stderr, case-insensitive: %(choices)s (default: WARNING)"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `forerun generate: error: ...` and where to find the usage.

    The full usage of a subcommand runs to a dozen lines and buries the one line that says what was
    wrong; `--help` still prints it."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _log_level(value: str) -> str:
    level = value.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(x.lower() for x in LOG_LEVELS)}")
    return level


def _add_log_level(p: argparse.ArgumentParser, top: bool) -> None:
    """--log-level on the top parser and on every subcommand, so it may come before or after the
    subcommand. A subcommand's copy has no default, so it never overwrites a level given earlier."""
    p.add_argument("--log-level", type=_log_level, choices=LOG_LEVELS, metavar="LEVEL",
                   default="WARNING" if top else argparse.SUPPRESS, help=_LOG_LEVEL_HELP)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256,
                   help="the most tokens to generate for each answer (default: %(default)s)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature: higher is more random, 0 is greedy (default: %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: keep the most likely tokens whose probabilities add up to P; 1 keeps "
                        "all (default: %(default)s)")
    g.add_argument("--top-k", type=int, default=0,
                   help="keep only the K most likely tokens; 0 or -1 keeps all (default: %(default)s)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens whose probability is below P times the most likely token's; 0 keeps all "
                        "(default: %(default)s)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="scale the logits of tokens already in the prompt or the answer: above 1 discourages "
                        "repeats, below 1 encourages them, 1 is off (default: %(default)s)")
    g.add_argument("--sampling-seed", type=int, default=None,
                   help="seed of the request's own random generator, so sampling repeats exactly (default: "
                        "none: sample from the engine's generator, seeded by --seed)")
    g.add_argument("--stop", action="append", default=None,
                   help="stop the answer where this string appears, leaving it out; repeat the flag for "
                        "several (default: none, only the model's end-of-sequence token)")


def _sampling_params(args: argparse.Namespace):
    from forerun.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.sampling_seed, stop=args.stop)


class _Interrupt:
    """SIGINT while an answer streams: the first one asks the stream to stop at the next step boundary
    (the request is aborted in the engine, the chat goes on); a second one before that raises
    KeyboardInterrupt as usual.

    Invariant: inside the `with` block SIGINT never interrupts an engine step half way, so the engine's
    state stays consistent; outside it the previous handler is back in place."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Callable | int | None = None

    def __enter__(self) -> _Interrupt:
        self.requested = False
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.signal(signal.SIGINT, self._previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True


def _stream(engine, prompt, params, out: TextIO = sys.stdout, interrupt: _Interrupt | None = None) -> str:
    """Run one request to completion, writing text to `out` as it arrives. When `interrupt` is
    requested the request is aborted in the engine and the text written so far is returned."""
    request_id = engine.add_request(prompt, params)
    parts: list[str] = []
    while engine.has_unfinished_requests():
        if interrupt is not None and interrupt.requested:
            engine.abort_request(request_id)
            logger.info("request %s aborted after %d characters", request_id, sum(map(len, parts)))
            # Steps already in flight (async scheduling) still come back; apply them so the engine is idle.
            while engine.has_unfinished_requests():
                engine.step()
            break
        for ro in engine.step():
            if interrupt is not None and interrupt.requested:
                break  # nothing more is shown after Ctrl-C, though the step that was running produced it
            delta = ro.outputs[0].delta_text
            if delta:
                parts.append(delta)
                out.write(delta)
                out.flush()
            if ro.finished and ro.outputs[0].error:
                raise RuntimeError(ro.outputs[0].error)
    out.write("\n")
    out.flush()
    return "".join(parts)


def _warn_if_truncated(engine, prompt, max_tokens: int | None) -> None:
    """A one-line warning when `max_tokens` cannot fit after the prompt: the engine then stops at
    max_model_len (finish reason "length"), which would otherwise look like a short answer."""
    num_prompt = len(prompt) if isinstance(prompt, list) else len(engine.tokenizer.encode(prompt))
    max_model_len = engine.core.max_model_len
    room = max_model_len - num_prompt
    if max_tokens is not None and 0 < room < max_tokens:
        print(f"forerun: warning: the prompt is {num_prompt} tokens and --max-tokens is {max_tokens}, but "
              f"max_model_len is {max_model_len}: the answer stops after at most {room} tokens", file=sys.stderr)


def cmd_generate(args: argparse.Namespace) -> int:
    from forerun.engine.llm_engine import LLMEngine
    engine = LLMEngine(engine_config_from_args(args))
    try:
        prompt = args.prompt
        if args.chat:
            text = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            prompt = engine.tokenizer.encode(text, add_special_tokens=False)
        params = _sampling_params(args)
        _warn_if_truncated(engine, prompt, params.max_tokens)
        _stream(engine, prompt, params)
    finally:
        engine.shutdown()
    return 0


def _start_engine_without_sigint(config):
    """An LLMEngine whose worker processes ignore SIGINT.

    Ctrl-C in a terminal reaches the whole process group; a worker that took it would die and take the
    engine with it, while chat only means to stop one answer. A signal ignored at spawn stays ignored
    in the child, so SIGINT is ignored while the engine starts its workers (only when it has any: a
    single-process engine keeps Ctrl-C during loading)."""
    from forerun.engine.llm_engine import LLMEngine
    if config.distributed_executor_backend == "uni":
        return LLMEngine(config)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return LLMEngine(config)
    finally:
        signal.signal(signal.SIGINT, previous)


def cmd_chat(args: argparse.Namespace) -> int:
    engine = _start_engine_without_sigint(engine_config_from_args(args))
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interrupt = _Interrupt()
    try:
        print("forerun chat: type a message; Ctrl-C stops an answer; an empty line, Ctrl-D or Ctrl-C at the "
              "prompt quits.", file=sys.stderr)
        while True:
            try:
                line = input("> ")
            except (EOFError, KeyboardInterrupt):
                # Ctrl-D and Ctrl-C leave the cursor after the prompt: end the line for the shell's prompt.
                sys.stdout.write("\n")
                sys.stdout.flush()
                break
            if not line.strip():
                break
            messages.append({"role": "user", "content": line})
            text = engine.tokenizer.apply_chat_template(messages)
            with interrupt:
                reply = _stream(engine, engine.tokenizer.encode(text, add_special_tokens=False),
                                _sampling_params(args), interrupt=interrupt)
            # An interrupted answer stays in the conversation as far as it was shown.
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
    import json

    from forerun.bench.embed_bench import run
    print(json.dumps(run(args), indent=2))  # a benchmark prints its JSON, as `bench throughput` does
    return 0


def cmd_bench_invariance(args: argparse.Namespace) -> int:
    import json

    from forerun.bench.invariance import run
    print(json.dumps(run(args), indent=2))
    return 0


def build_parser(with_bench: bool = True) -> argparse.ArgumentParser:
    """The whole command line; `with_bench=False` leaves out the benchmarks' own options, whose modules
    import numpy: the server's front end would hold its 15 MB for nothing (`main` adds them when the
    command line names `bench`)."""
    parser = _Parser(prog="forerun", description="An LLM serving engine that schedules one step ahead.")
    _add_log_level(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, help="what to run; `forerun COMMAND --help` "
                                "lists its options")

    text = "complete one prompt, streaming tokens to the terminal"
    p = sub.add_parser("generate", help=text, description=text)
    p.add_argument("prompt", help="the text to complete")
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the model's chat template (default: off: "
                        "the prompt is completed as plain text)")
    add_engine_args(p)
    _add_sampling_args(p)
    _add_log_level(p, top=False)
    p.set_defaults(fn=cmd_generate)

    text = "interactive chat that keeps the conversation"
    p = sub.add_parser("chat", help=text, description=text)
    p.add_argument("--system", default=None,
                   help="system message that opens the conversation (default: none)")
    add_engine_args(p)
    _add_sampling_args(p)
    _add_log_level(p, top=False)
    p.set_defaults(fn=cmd_chat)

    text = "OpenAI-compatible HTTP server"
    p = sub.add_parser("serve", help=text, description=text)
    from forerun.entrypoints.serve import add_serve_args
    add_serve_args(p)
    _add_log_level(p, top=False)
    p.set_defaults(fn=cmd_serve)

    text = "benchmarks: offline throughput, serving latency, embeddings, batch invariance"
    bench_parser = sub.add_parser("bench", help=text, description=text)
    _add_log_level(bench_parser, top=False)
    if with_bench:
        _add_bench_commands(bench_parser)
    return parser


def _add_bench_commands(parser: argparse.ArgumentParser) -> None:
    bench = parser.add_subparsers(dest="bench", required=True,
                                  help="which benchmark; `forerun bench BENCHMARK --help` lists its options")
    text = "offline throughput of the engine, printed as JSON; --compare-async for sync vs async"
    p = bench.add_parser("throughput", help=text, description=text)
    from forerun.bench.throughput import add_args as add_throughput_args
    add_throughput_args(p)
    _add_log_level(p, top=False)
    p.set_defaults(fn=cmd_bench_throughput)
    text = "latency and throughput against a running OpenAI-compatible server"
    p = bench.add_parser("serve", help=text, description=text)
    from forerun.bench.serve_bench import add_args as add_serve_bench_args
    add_serve_bench_args(p)
    _add_log_level(p, top=False)
    p.set_defaults(fn=cmd_bench_serve)
    text = "embeddings per second, forerun (async off and on) vs transformers"
    p = bench.add_parser("embed", help=text, description=text)
    from forerun.bench.embed_bench import add_args as add_embed_bench_args
    add_embed_bench_args(p)
    _add_log_level(p, top=False)
    p.set_defaults(fn=cmd_bench_embed)
    text = ("whether a request's tokens and logprobs depend on what runs beside it: counts of targets equal "
            "to their run alone, amid random requests, chunked, after prefix-cache hits, sync")
    p = bench.add_parser("invariance", help=text, description=text)
    from forerun.bench.invariance import add_args as add_invariance_args
    add_invariance_args(p)
    _add_log_level(p, top=False)
    p.set_defaults(fn=cmd_bench_invariance)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(with_bench="bench" in argv).parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except ValueError as exc:
        # Bad input (a flag, the model's config, a prompt) raises ValueError naming the field: that one
        # line is the whole story, as argparse's own errors are. `--log-level debug` keeps the traceback.
        logger.debug("the error's traceback", exc_info=True)
        print(f"forerun: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C mid-answer leaves the cursor mid-line; the shell's prompt belongs on a line of its own.
        print(file=sys.stdout, flush=True)
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

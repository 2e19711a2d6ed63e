#!/usr/bin/env bash
# Side-by-side CPU benchmark: `pagoda bench` and llama.cpp's `llama-bench`, alternating, on the
# same model and thread counts, with the machine load recorded before every run.
#
#   scripts/bench-cpu-vs-llamacpp.sh [LLAMA_BENCH] [ROUNDS]
#
# LLAMA_BENCH: path of llama-bench (default: $LLAMA_BENCH or llama-bench on PATH).
# ROUNDS: how many times the pair is alternated per thread count (default 3).
# Env: THREADS="1 2" (thread counts), KERNELS="auto vnni f32" (on aarch64 "auto neon f32": the
# NEON sets, issue 48; pagoda's PAGODA_CPU_KERNELS values,
# each a separate row; "auto/int8" also sets PAGODA_CPU_AMX_PREFILL=int8), BUSY=1 also runs every pair with one busy process (a shell spin loop)
# competing for the CPUs, to measure behaviour when oversubscribed. PIN="taskset -c 0,1" runs
# every benchmark under that prefix (a 2-core slice of a larger machine), MODEL another model,
# BEFORE=path a second pagoda binary run beside the first in every round (rows "before:SET",
# for before/after tables).
# RUN_TIMEOUT (seconds, default 300) bounds each run: llama.cpp's spinning thread pool can take
# minutes per run when oversubscribed (BUSY=1); such a run prints "timeout" and the rounds go on.
# Prints one line per run: tool, threads, busy, load, pp128, pp512, tg128 (tokens/s), and for
# pagoda the counts of matmuls that ran on AMX-INT8 and AMX-BF16 tiles (int8+bf16).
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA_BENCH=${1:-${LLAMA_BENCH:-llama-bench}}
ROUNDS=${2:-3}
THREADS=${THREADS:-"1 2"}
if [ "$(uname -m)" = aarch64 ]; then
  # auto is neon_dotprod+f32_ffn_down where the CPU has dotprod; `neon` is the set without it.
  KERNELS=${KERNELS:-"auto neon f32"}
else
  KERNELS=${KERNELS:-"auto vnni f32"}
fi
MODEL=${MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
PIN=${PIN:-}
PAGODA=${PAGODA:-target/release/pagoda}
BEFORE=${BEFORE:-}
RUN_TIMEOUT=${RUN_TIMEOUT:-300}

[ -f "$MODEL" ] || scripts/fetch-model.sh
[ -x "$PAGODA" ] || cargo build --release -p pagoda-cli
command -v "$LLAMA_BENCH" >/dev/null || { echo "llama-bench not found: pass its path" >&2; exit 1; }

busy_pid=""
# The busy process shares the benchmark's CPUs (under PIN too).
start_busy() { $PIN bash -c 'while :; do :; done' & busy_pid=$!; }
stop_busy() { [ -n "$busy_pid" ] && kill "$busy_pid" 2>/dev/null; busy_pid=""; }
trap stop_busy EXIT

pagoda_run() { # threads kernels[/amx_prefill] [binary] -> "pp128 pp512 tg128 amx_int8+amx_bf16"
  local kernels=${2%%/*} prefill= binary=${3:-$PAGODA}
  [ "$kernels" != "$2" ] && prefill=${2#*/}
  PAGODA_CPU_KERNELS="$kernels" PAGODA_CPU_AMX_PREFILL="$prefill" timeout "$RUN_TIMEOUT" $PIN "$binary" bench --device cpu -m "$MODEL" -t "$1" -p 128,512 -n 128 -r 3 --json 2>/dev/null |
    python3 -c 'import json,sys; j=json.load(sys.stdin); r={x["test"]:x["median"] for x in j["results"]}; print("%.1f %.1f %.1f %d+%d"%(r["pp128"],r["pp512"],r["tg128"],j["amx_matmuls"],j.get("amx_bf16_matmuls",0)))'
}
llama_run() {
  timeout "$RUN_TIMEOUT" $PIN "$LLAMA_BENCH" -m "$MODEL" -t "$1" -p 128,512 -n 128 -r 3 -o json 2>/dev/null |
    python3 -c 'import json,sys
r={}
for x in json.load(sys.stdin):
    key=("pp%d"%x["n_prompt"]) if x["n_prompt"] else ("tg%d"%x["n_gen"])
    r[key]=x["avg_ts"]
print("%.1f %.1f %.1f -"%(r["pp128"],r["pp512"],r["tg128"]))'
}

echo "tool threads busy load1 pp128 pp512 tg128 amx_int8+bf16_matmuls"
for busy in 0 ${BUSY:+1}; do
  for t in $THREADS; do
    for _ in $(seq "$ROUNDS"); do
      for tool in $(for k in $KERNELS; do echo "pagoda:$k"; [ -n "$BEFORE" ] && echo "before:$k"; done) llama.cpp; do
        [ "$busy" = 1 ] && start_busy
        load=$(cut -d' ' -f1 /proc/loadavg)
        case "$tool" in
          pagoda:*) out=$(pagoda_run "$t" "${tool#pagoda:}") || out="timeout - - -" ;;
          before:*) out=$(pagoda_run "$t" "${tool#before:}" "$BEFORE") || out="timeout - - -" ;;
          *) out=$(llama_run "$t") || out="timeout - - -" ;;
        esac
        stop_busy
        echo "$tool $t $busy $load $out"
      done
    done
  done
done

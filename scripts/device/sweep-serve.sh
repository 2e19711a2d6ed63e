#!/usr/bin/env bash
# Issue 35's H200 sweep: `pagoda serve --random-weights llama-3.1-8b` (the default model's
# tokenizer from a metadata-only GGUF) under Poisson arrivals of ShareGPT-like requests, one
# server start per configuration, every configuration over the same rates.
#
#   CONFIGS="256:512 512:2048" RATES=80,100,120 TOK=.devc/tok.gguf bash scripts/device/sweep-serve.sh
#
# CONFIGS: space-separated `parallel:batch_tokens[:ENV=VALUE,...]` (-np and -b of the server,
# and settings for its environment). Writes $OUT/sweep-<n>.json, the server logs and metrics,
# and prints one table of every configuration's rates last.
set -uo pipefail
OUT="${OUT:-/tmp/out}"
TOK="${TOK:-.devc/tok.gguf}"
RATES="${RATES:-80,100,120,140}"
PROMPTS="${PROMPTS:-1000}"
PORT="${PORT:-8089}"
PRESET="${PRESET:-llama-3.1-8b}"
URL="http://127.0.0.1:$PORT"
mkdir -p "$OUT"
n=0
for config in ${CONFIGS:-256:512}; do
    n=$((n + 1))
    IFS=: read -r np budget envs <<< "$config"
    env_args=()
    [[ -n "${envs:-}" ]] && IFS=, read -r -a env_args <<< "$envs"
    env "${env_args[@]}" pagoda serve --random-weights "$PRESET" -m "$TOK" --device cuda --port "$PORT" \
        -np "$np" --max-queue 8192 -b "$budget" -c 4096 --kv-memory-fraction 0.8 \
        > "$OUT/server-$n.log" 2>&1 &
    server=$!
    for _ in $(seq 600); do curl -sf "$URL/health" > /dev/null && break; sleep 0.5; done
    pagoda bench serve --url "$URL" --sweep "$RATES" --num-prompts "$PROMPTS" \
        --slo-ttft 1000 --slo-tpot 50 --label "np$np-b$budget${envs:+-$envs}" --json \
        > "$OUT/sweep-$n.json" 2>> "$OUT/sweep-errors.log"
    curl -s "$URL/metrics" > "$OUT/metrics-$n.txt"
    kill "$server"; wait "$server"
done
python3 - "$OUT" <<'PY'
import glob, json, os, sys
print("| config | offered | achieved req/s | out tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms | ITL p50/p99 ms | goodput | SLO |")
print("|---|---:|---:|---:|---:|---:|---:|---:|:-:|")
for path in sorted(glob.glob(os.path.join(sys.argv[1], "sweep-*.json"))):
    try:
        rep = json.load(open(path))
    except Exception as e:
        print(f"| {os.path.basename(path)} | unreadable: {e} |")
        continue
    for p in rep["rates"]:
        t, o, i = p["ttft_ms"], p["tpot_ms"], p["itl_ms"]
        print(f"| {rep['label']} | {p['request_rate']} | {p['request_throughput']:.2f} | {p['output_token_throughput']:.0f} | "
              f"{t['median']:.0f} / {t['p99']:.0f} | {o['median']:.1f} / {o['p99']:.1f} | {i['median']:.1f} / {i['p99']:.1f} | "
              f"{p.get('goodput') or 0:.2f} | {'yes' if p['within_slo'] else 'no'} |")
    print(f"| {rep['label']} | sustained: {rep['sustained_rate']} |")
PY

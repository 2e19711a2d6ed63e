#!/usr/bin/env bash
# Issue 41's bar: three CPU pagoda workers (one thread each) behind Dynamo's frontend on a
# shared-prefix workload, KV-aware routing against round-robin, the same requests and arrivals
# for both: prefix hit rate (prompt tokens served from the workers' prefix caches) and
# goodput (p99 TTFT <= 2 s, p99 TPOT <= 100 ms).
#
#   [MODES="kv round-robin"] bash scripts/bench-dynamo-routing.sh [RATE] [NUM_PROMPTS]
#
# The workload: PREFIXES long system prompts (about 300 tokens each), each followed by short
# questions, shuffled; each worker's KV pool (KV_PAGES pages of 16 tokens) holds about two
# prefixes besides its running requests, so a router that scatters a prefix over the workers
# makes them recompute it. Needs the worker build and the Dynamo venv (scripts/test-dynamo.sh
# says how) and `pagoda` (PAGODA_BIN, default target/debug/pagoda) as the load generator.
# Writes /tmp/dynamo-routing-<mode>.json and prints a table last.
set -euo pipefail
cd "$(dirname "$0")/.."
rate=${1:-2}
prompts=${2:-90}
worker=${PAGODA_DYNAMO:-/tmp/dynprobe/target/release/pagoda-dynamo}
bin=${PAGODA_BIN:-target/debug/pagoda}
python=${DYNAMO_PYTHON:-/tmp/dynvenv/bin/python}
model=${PAGODA_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
kv_pages=${KV_PAGES:-64}
prefixes=${PREFIXES:-6}
work=$(mktemp -d)
pids=()
stop_all() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    sleep 1
    for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
    pids=()
}
trap 'stop_all; rm -rf "$work"' EXIT
source scripts/dynamo-ports.sh

PREFIXES=$prefixes PROMPTS=$prompts "$python" - > "$work/dataset.jsonl" <<'PY'
import json, os, random
rng = random.Random(41)
topics = ["harbours", "printing", "glaciers", "violins", "railways", "bees", "tides", "lenses"]
prefixes = []
for p in range(int(os.environ["PREFIXES"])):
    rules = " ".join(f"Rule {i} of the {topics[p % len(topics)]} desk: answer in one sentence, "
                     f"cite one source, and never guess about item {p * 100 + i}." for i in range(12))
    prefixes.append(f"You are the {topics[p % len(topics)]} assistant. {rules}\n")
for n in range(int(os.environ["PROMPTS"])):
    p = rng.randrange(len(prefixes))
    print(json.dumps({"prompt": f"{prefixes[p]}Question {n}: what does rule {n % 12} say?",
                      "max_tokens": 24}))
PY

printf '| router | achieved req/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | goodput req/s | prefix hit rate |\n|---|---:|---:|---:|---:|---:|\n' > "$work/table.md"
for mode in ${MODES:-round-robin kv}; do
    port=$(free_port)
    export DYN_DISCOVERY_BACKEND=file DYN_FILE_KV=$work/discovery-$mode DYN_REQUEST_PLANE=tcp \
        DYN_EVENT_PLANE=zmq DYN_NAMESPACE=pagoda-bench-$mode-$$ DYN_TCP_RPC_HOST=127.0.0.1 \
        DYN_TCP_RESPONSE_STREAM_HOST=127.0.0.1
    mkdir -p "$DYN_FILE_KV"
    extra=()
    [[ $mode == kv ]] && extra=(--router-kv-events)
    "$python" -m dynamo.frontend --http-port "$port" --router-mode "$mode" "${extra[@]}" \
        > "$work/frontend-$mode.log" 2>&1 &
    pids+=($!)
    metrics=()
    for i in 1 2 3; do
        mp=$(free_port)
        metrics+=("$mp")
        DYN_SYSTEM_PORT=$mp "$worker" -m "$model" --threads 1 --parallel 2 -c 1024 \
            --kv-pages "$kv_pages" --card-dir "$work/card" > "$work/worker-$mode-$i.log" 2>&1 &
        pids+=($!)
    done
    for _ in $(seq 600); do
        ready=$( (grep -l "pagoda engine ready" "$work"/worker-"$mode"-*.log 2>/dev/null || true) | wc -l)
        [[ $ready -eq 3 ]] && break
        sleep 0.5
    done
    [[ $ready -eq 3 ]] || { echo "error: the $mode workers did not start" >&2; tail "$work"/*.log; exit 1; }
    for _ in $(seq 120); do
        curl -sf "http://127.0.0.1:$port/v1/models" | grep -q SmolLM2 && break
        sleep 0.5
    done
    "$bin" bench serve --url "http://127.0.0.1:$port" --dataset "$work/dataset.jsonl" \
        --request-rate "$rate" --num-prompts "$prompts" --slo-ttft 2000 --slo-tpot 100 \
        --label "dynamo-$mode" --json > "/tmp/dynamo-routing-$mode.json"
    hits=0
    for mp in "${metrics[@]}"; do
        h=$(curl -s "http://127.0.0.1:$mp/metrics" | awk '/^pagoda_prefix_cache_hit_tokens_total/ {print $2}')
        echo "$mode worker on $mp: ${h:-?} prefix-hit tokens"
        hits=$(awk -v a="$hits" -v b="${h:-0}" 'BEGIN {print a + b}')
    done
    HITS=$hits MODE=$mode "$python" - "/tmp/dynamo-routing-$mode.json" >> "$work/table.md" <<'PY'
import json, os, sys
r = json.load(open(sys.argv[1]))
m = r.get("rates", [r])[0] if "rates" in r else r
inp = (m["total_token_throughput"] - m["output_token_throughput"]) * m["duration_s"]
t, o = m["ttft_ms"], m["tpot_ms"]
print(f"| {os.environ['MODE']} | {m['request_throughput']:.2f} | {t['median']:.0f} / {t['p99']:.0f} | "
      f"{o['median']:.1f} / {o['p99']:.1f} | {m.get('goodput') or 0:.2f} | "
      f"{float(os.environ['HITS']) / max(inp, 1):.3f} |")
PY
    stop_all
done
echo "rate $rate req/s, $prompts requests, $prefixes prefixes, $kv_pages pages per worker"
cat "$work/table.md"

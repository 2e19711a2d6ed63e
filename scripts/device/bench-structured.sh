#!/usr/bin/env bash
# Issue 39's GPU table: decode tok/s with and without a JSON schema at 1, 16 and 64 clients,
# random Llama-3.1-8B weights with the default model's tokenizer (a metadata-only GGUF, see
# scripts/gguf-metadata-only.py), free and schema alternating over ROUNDS rounds, each with
# its own prompts (seeds 2R and 2R+1) so the prefix cache cannot serve one from the other.
#
#   MASKS="on off" ROUNDS=5 TOK=.devc/tok.gguf bash scripts/device/bench-structured.sh
#
# SCEN16 (default single,batch4): the scenarios run at 16 clients; C64=0 skips 64 clients
# (with SCEN16=batch4 the step counters then describe 16-client steps only).
#
# Writes $OUT/structured-<masks>-r<R>-<free|schema>-c<clients>.json, the server logs and
# metrics, and prints the median table last.
set -uo pipefail
OUT="${OUT:-/tmp/out}"
TOK="${TOK:-.devc/tok.gguf}"
ROUNDS="${ROUNDS:-5}"
PORT="${PORT:-8092}"
PRESET="${PRESET:-llama-3.1-8b}"
SCEN16="${SCEN16:-single,batch4}"
C64="${C64:-1}"
S='{"type":"array","items":{"type":"integer","minimum":0,"maximum":999},"minItems":400}'
URL="http://127.0.0.1:$PORT"
mkdir -p "$OUT"
for masks in ${MASKS:-on}; do
    PAGODA_CUDA_DEVICE_MASKS=$masks pagoda serve --random-weights "$PRESET" -m "$TOK" \
        --device cuda --port "$PORT" -np 64 -c 1024 > "$OUT/server-$masks.log" 2>&1 &
    server=$!
    for _ in $(seq 240); do curl -sf "$URL/health" > /dev/null && break; sleep 0.5; done
    for r in $(seq "$ROUNDS"); do
        for kind in free schema; do
            seed=$((2 * r)); [[ $kind == schema ]] && seed=$((seed + 1))
            extra=()
            [[ $kind == schema ]] && extra=(--json-schema "$S")
            pagoda bench serve --url "$URL" --scenarios "$SCEN16" --clients 16 -n 128 -r 1 \
                --seed "$seed" --json "${extra[@]}" > "$OUT/structured-$masks-r$r-$kind-c16.json" 2>> "$OUT/bench-errors.log"
            [[ $C64 == 0 ]] && continue
            pagoda bench serve --url "$URL" --scenarios batch4 --clients 64 -n 128 -r 1 \
                --seed "$((seed + 100))" --json "${extra[@]}" > "$OUT/structured-$masks-r$r-$kind-c64.json" 2>> "$OUT/bench-errors.log"
        done
    done
    curl -s "$URL/metrics" > "$OUT/metrics-$masks.txt"
    kill "$server"; wait "$server"
done
python3 - "$OUT" <<'PY'
import glob, json, os, re, statistics, sys
out = sys.argv[1]
cells = {}
for path in sorted(glob.glob(os.path.join(out, "structured-*.json"))):
    m = re.match(r"structured-(\w+)-r(\d+)-(free|schema)-c(\d+)\.json", os.path.basename(path))
    try:
        report = json.load(open(path))
    except Exception:
        continue
    for res in report["results"]:
        key = (m.group(1), res["scenario"], res["clients"])
        cells.setdefault(key, {"free": [], "schema": []})[m.group(3)].append(res["throughput_tokens_per_second"])
print("| device masks | scenario | clients | free | JSON schema | schema / free |")
print("|---|---|---|---|---|---|")
for (masks, scen, clients), v in sorted(cells.items()):
    if not v["free"] or not v["schema"]:
        continue
    f, s = statistics.median(v["free"]), statistics.median(v["schema"])
    fr = ", ".join(f"{x:.0f}" for x in v["free"]); sr = ", ".join(f"{x:.0f}" for x in v["schema"])
    print(f"| {masks} | {scen} | {clients} | {f:.1f} ({fr}) | {s:.1f} ({sr}) | {s / f:.3f} |")
PY
grep -h -E "^pagoda_(constrained_requests_total|cuda_masked_rows_total|structured_mask_microseconds_total|draw_stage_microseconds_total|engine_step_microseconds_total|engine_steps_total)" "$OUT"/metrics-*.txt

#!/usr/bin/env bash
# Issue 37's GPU tables in one call: the MLA decode kernel at DeepSeek-V2-Lite's 16 heads and
# V3's 128 (latent-cache read rate from 1 GB of cache), then end-to-end decode of random
# Qwen3-30B-A3B and DeepSeek-V2-Lite weights (bf16) at batch 1 and 64, with the byte floor the
# bench prints. Run from scripts/device/run.sh (pagoda on the PATH).
#
#   MLA_HEADS="16 128" MODELS="qwen3-30b-a3b deepseek-v2-lite" bash scripts/device/bench-moe-mla.sh
#
# Writes $OUT/mla-h<heads>.json and $OUT/e2e-<model>.md (+ logs), prints them last.
set -uo pipefail
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
for h in ${MLA_HEADS:-16 128}; do
    timeout 150 pagoda bench attention --mla --q-heads "$h" -b "${MLA_BATCH:-1,4,16,64}" \
        -l "${MLA_CONTEXT:-1024,4096,16384}" --json > "$OUT/mla-h$h.json" 2> "$OUT/mla-h$h.log"
    echo "mla h=$h rc=$?"
done
for m in ${MODELS:-qwen3-30b-a3b deepseek-v2-lite}; do
    timeout "${E2E_TIMEOUT:-180}" pagoda bench --device cuda --random-weights "$m" \
        -b "${E2E_BATCH:-1,64}" -p "${E2E_PROMPT:-512}" -n "${E2E_GEN:-64}" -r 3 \
        > "$OUT/e2e-$m.md" 2> "$OUT/e2e-$m.log"
    echo "e2e $m rc=$?"
    tail -3 "$OUT/e2e-$m.log"
done
for h in ${MLA_HEADS:-16 128}; do
    python3 - "$OUT/mla-h$h.json" "$h" <<'PY'
import json, sys
try:
    cases = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"mla h={sys.argv[2]}: no JSON ({e})"); sys.exit()
cases = cases.get("cases", cases) if isinstance(cases, dict) else cases
print(f"MLA decode, {sys.argv[2]} heads: B x L, cache MB, floor us, then path median us / GB/s")
for c in cases:
    cells = "  ".join(f"{p['path']} {p['median_us']:.1f}us {p['gb_per_s']:.0f}GB/s" for p in c["paths"])
    print(f"  B={c['batch']:>3} L={c['context']:>6} {c['cache_mb']:8.1f}MB floor {c['floor_us']:7.1f}  {cells}")
PY
done
for m in ${MODELS:-qwen3-30b-a3b deepseek-v2-lite}; do
    echo "== $m"; grep -E "^\| |^model|random weights" "$OUT/e2e-$m.md" "$OUT/e2e-$m.log"
done

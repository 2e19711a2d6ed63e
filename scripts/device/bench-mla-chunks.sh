#!/usr/bin/env bash
# The MLA decode's smallest chunk (issue 37): `pagoda bench attention --mla` at each
# --min-chunk-keys in KEYS, one table of median us per case and key count (each chunk writes a
# partial of heads x 512 f32 that the merge reads back, so small chunks cost at small batches).
#
#   KEYS="64 256 1024" HEADS=16 bash scripts/device/bench-mla-chunks.sh
#
# Writes $OUT/mla-k<keys>.json.
set -uo pipefail
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
KEYS="${KEYS:-64 256 1024}"
for k in $KEYS; do
    timeout 120 pagoda bench attention --mla --q-heads "${HEADS:-16}" -b "${BATCH:-1,4,16,64}" \
        -l "${CONTEXT:-4096,16384}" --min-chunk-keys "$k" --paths mla-mma --json \
        > "$OUT/mla-k$k.json" 2> "$OUT/mla-k$k.log"
    echo "min chunk keys $k rc=$?"
done
python3 - "$OUT" $KEYS <<'PY'
import json, os, sys
out, keys = sys.argv[1], sys.argv[2:]
runs = {}
for k in keys:
    try:
        runs[k] = {(c["batch"], c["context"]): c for c in json.load(open(os.path.join(out, f"mla-k{k}.json")))}
    except Exception as e:
        print(f"keys {k}: no JSON ({e})")
cases = sorted({case for r in runs.values() for case in r})
print("| B | context | " + " | ".join(f"min {k} keys: us (chunks x pages)" for k in runs) + " |")
print("|---:|---:|" + "---:|" * len(runs))
for case in cases:
    cells = []
    for k, r in runs.items():
        c = r.get(case)
        p = c["paths"][0] if c else None
        cells.append(f"{p['median_us']:.1f} ({p['chunks']} x {p['pages_per_chunk']})" if p else "-")
    print(f"| {case[0]} | {case[1]} | " + " | ".join(cells) + " |")
PY

#!/usr/bin/env bash
# Kernel time breakdown of a pagoda command on the GPU machine, with Nsight Systems when the
# machine has it (`nsys`, searched on PATH and under /usr/local/cuda*/ and /opt/nvidia):
# prints the top kernels by total GPU time (`cuda_gpu_kern_sum`). Also prints the device's
# copy rate (torch, 4 GiB device-to-device, read + write counted), the figure byte floors are
# taken against. Run from scripts/device/run.sh (pagoda on the PATH).
#
#   TOP=25 bash scripts/device/profile.sh pagoda bench --device cuda --random-weights qwen3-30b-a3b -b 1 -n 32 -r 1
#
# Writes $OUT/profile.nsys-rep (when nsys ran) and $OUT/kernels.txt.
set -uo pipefail
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
python3 - <<'PY' 2>/dev/null || echo "copy rate: torch unavailable"
import torch
n = 1 << 31  # 2 Gi bf16 values = 4 GiB
a = torch.empty(n, dtype=torch.bfloat16, device="cuda"); b = torch.empty_like(a)
for _ in range(3): b.copy_(a)
torch.cuda.synchronize()
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
times = []
for _ in range(10):
    s.record(); b.copy_(a); e.record(); torch.cuda.synchronize(); times.append(s.elapsed_time(e))
times.sort()
print(f"copy rate: {2 * a.numel() * 2 / (times[5] / 1e3) / 1e12:.2f} TB/s (read + write, median of 10, 4 GiB)")
PY
nsys=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
if [[ -z $nsys || $# -eq 0 ]]; then
    echo "nsys: ${nsys:-not found}"
    [[ $# -gt 0 ]] && "$@"
    exit 0
fi
echo "nsys: $nsys"
"$nsys" profile -o "$OUT/profile" --force-overwrite true --trace cuda --sample none \
    --cpuctxsw none "$@" > "$OUT/profiled-command.log" 2>&1
echo "profiled command rc=$?"
"$nsys" stats --report cuda_gpu_kern_sum --format csv "$OUT/profile.nsys-rep" \
    > "$OUT/kernels.csv" 2> "$OUT/stats.log"
python3 - "$OUT/kernels.csv" "${TOP:-25}" <<'PY' | tee "$OUT/kernels.txt"
import csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
head = next(i for i, r in enumerate(rows) if "Time (%)" in r[0] or "Time(%)" in r[0])
keys = rows[head]
table = [dict(zip(keys, r)) for r in rows[head + 1:]]
print("| % | total ms | calls | avg us | kernel |")
print("|---:|---:|---:|---:|---|")
for r in table[: int(sys.argv[2])]:
    pct = r.get("Time (%)", r.get("Time(%)"))
    total = float(r.get("Total Time (ns)", 0)) / 1e6
    avg = float(r.get("Avg (ns)", 0)) / 1e3
    print(f"| {float(pct):.1f} | {total:.1f} | {r.get('Instances', '')} | {avg:.1f} | {r.get('Name', '')[:90]} |")
PY

"""FlashInfer's FA2 batch prefill over a paged KV cache, timed the way `pagoda bench
attention --prefill` times ours: causal prompts of L tokens for B requests, Llama-3.1-8B
attention shape (32 query heads, 8 KV heads, head_dim 128, bf16, NHD pages of 16), every
request's pages drawn at random from a large pool, R rotating input sets of at least 4x the
L2 captured in one CUDA graph, median replay time / R.

Runs on the GPU machine after `.fi/run_device.sh` installed the kit (PYTHONPATH=/tmp/fipkg:/tmp/site):
    python3 scripts/fi-prefill.py [--batch 1,4,16] [--context 512,2048,8192,16384]
"""
import argparse
import math
import statistics

import torch

HQ, HKV, D, PS = 32, 8, 128, 16
L2 = 60 * 2**20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,4,16")
    ap.add_argument("--context", default="512,2048,8192,16384")
    ap.add_argument("--replays", type=int, default=10)
    args = ap.parse_args()
    import flashinfer as fi
    import flashinfer.prefill  # noqa: F401  (the kit's trimmed package imports no submodule)
    dev = torch.device("cuda")
    batches = [int(x) for x in args.batch.split(",")]
    contexts = [int(x) for x in args.context.split(",")]
    largest = max(b * l for b in batches for l in contexts)
    pages = largest // PS + (1 << 30) // (PS * HKV * D * 2)
    kp = torch.randn(pages, PS, HKV, D, device=dev, dtype=torch.bfloat16)
    vp = torch.randn(pages, PS, HKV, D, device=dev, dtype=torch.bfloat16)
    ws = torch.empty(512 * 2**20, dtype=torch.uint8, device=dev)
    gen = torch.Generator(device="cpu").manual_seed(7)
    print(f"{'B':>3} {'L':>6} {'R':>3} {'fi_fa2 us':>12} {'TFLOP/s':>8}", flush=True)
    for b in batches:
        for l in contexts:
            npg = l // PS
            kv_bytes = b * l * HKV * D * 2 * 2
            q_bytes = b * l * HQ * D * 2
            sets = int(max(1, min(32, math.ceil(4 * L2 / (kv_bytes + q_bytes)))))
            qo = torch.arange(b + 1, dtype=torch.int32, device=dev) * l
            indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * npg
            last = torch.full((b,), PS, dtype=torch.int32, device=dev)
            fns = []
            for _ in range(sets):
                idx = torch.randint(0, pages, (b * npg,), generator=gen, dtype=torch.int32).to(dev)
                q = torch.randn(b * l, HQ, D, device=dev, dtype=torch.bfloat16)
                w = fi.prefill.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa2")
                w.plan(qo, indptr, idx, last, HQ, HKV, D, PS, causal=True,
                       q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
                fns.append(lambda w=w, q=q: w.run(q, (kp, vp)))
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for f in fns:
                    f()
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for f in fns:
                    f()
            g.replay()
            torch.cuda.synchronize()
            times = []
            for _ in range(args.replays):
                a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                z.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(z) * 1e3 / sets)
            us = statistics.median(times)
            flops = 2 * 2 * b * (l * (l + 1) / 2) * HQ * D
            print(f"{b:>3} {l:>6} {sets:>3} {us:>12.1f} {flops / us / 1e6:>8.1f}", flush=True)
            del g, fns
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Records llama.cpp's greedy run and top-5 logprobs on a GGUF file, in the format of
crates/models/tests/data/smollm2/llamacpp_q4_1_top5.json, for the llama.cpp parity test on
other files than the default model:

    python3 scripts/llamacpp-top5.py --server path/to/llama-server MODEL.gguf OUT.json
    PAGODA_PARITY_MODEL=MODEL.gguf PAGODA_PARITY_REFERENCE=OUT.json \\
        cargo test --release -p pagoda-models --test parity_llamacpp_quantized -- --nocapture

The prompts are the default reference's token ids (the same tokenizer), sent as ids; the
server runs as the default reference's did: one slot, one thread, `--no-repack`, greedy,
32 tokens, 5 log-probabilities per position (log-softmax of the raw logits). The server
reports none for a token that ends inside a UTF-8 character: those positions are left
empty.
"""

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "crates/models/tests/data/smollm2/llamacpp_q4_1_top5.json"


def post(port, path, body):
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--server", default="llama-server")
    p.add_argument("--port", type=int, default=18093)
    a = p.parse_args()
    prompts = json.loads(PROMPTS.read_text())["prompts"]
    cmd = [a.server, "-m", str(a.model), "--host", "127.0.0.1", "--port", str(a.port),
           "-c", "4096", "-np", "1", "-t", "1", "-tb", "1", "--no-repack"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{a.port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                time.sleep(0.2)
        else:
            sys.exit("llama-server did not come up")
        out = []
        for prompt in prompts:
            reply = post(a.port, "/completion", {
                "prompt": prompt["prompt_ids"], "n_predict": 32, "temperature": 0.0,
                "top_k": 1, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0,
                "repeat_last_n": 0, "seed": 0, "cache_prompt": False, "n_probs": 5,
                "return_tokens": True, "samplers": ["top_k"],
            })
            generated = reply["tokens"]
            # The server reports probabilities only for a token that completes a UTF-8
            # character (the pieces before it get none): align each report with the next
            # token of its id, and leave the other positions empty (the test skips them).
            top5 = [[] for _ in generated]
            cursor = 0
            for entry in reply["completion_probabilities"]:
                while generated[cursor] != entry["id"]:
                    cursor += 1
                top5[cursor] = [[e["id"], e["logprob"]] for e in entry["top_logprobs"]]
                cursor += 1
            out.append({
                "name": prompt["name"],
                "prompt_ids": prompt["prompt_ids"],
                "generated_ids": generated,
                "top5": top5,
            })
            print(prompt["name"], len(generated), "tokens", file=sys.stderr)
        meta = {"source": "llama.cpp llama-server", "server_cmd": " ".join(cmd[1:]),
                "model": a.model.name}
        a.out.write_text(json.dumps({"meta": meta, "prompts": out}, separators=(",", ":")) + "\n")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Is a seeded (or greedy) request's output the same alone and under load?

    python3 scripts/determinism-probe.py http://127.0.0.1:8080

Sends one completion alone twice, then three times beside seven others at once, at
temperature 0 and 0.8 with seed 7 (`ignore_eos`, 48 tokens, log-probabilities), and prints
per round whether the tokens match and the largest log-probability difference. Standard
library only, so it runs on the GPU machine as is. The CI's version, through the official
client, is tests/server/test_determinism.py.
"""
import json, sys, threading, urllib.request
url = sys.argv[1]
def complete(prompt, seed, temperature, max_tokens=48):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
            "logprobs": 1, "ignore_eos": True}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    choice = json.load(urllib.request.urlopen(req, timeout=300))["choices"][0]
    return choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]
prompts = [f"Story number {i}: once upon a time" for i in range(8)]
for temperature in (0.0, 0.8):
    alone = [complete(p, 7, temperature) for p in prompts[:1]] * 1
    again = complete(prompts[0], 7, temperature)
    results = [None] * 8
    def run(i):
        results[i] = complete(prompts[i], 7, temperature)
    for round_ in range(3):
        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        [t.start() for t in threads]; [t.join() for t in threads]
        loaded = results[0]
        same_tokens = loaded[0] == alone[0][0]
        diff = max(abs(a - b) for a, b in zip(loaded[1], alone[0][1]))
        first = next((i for i, (a, b) in enumerate(zip(loaded[0], alone[0][0])) if a != b), None)
        print(f"temp {temperature} round {round_}: alone twice same tokens {again[0] == alone[0][0]}, "
              f"alone vs 8 concurrent: same tokens {same_tokens}, first differing token {first}, "
              f"largest logprob difference {diff:.3e}")

"""A bounded soak of the real binary (issue 43), run by scripts/test-server.sh after the other
live tests: 64 clients at once against a server whose KV pool is too small for them all
(so the scheduler preempts), a fifth of the streams disconnecting early, chat and text,
streamed and whole; then a SIGTERM while streams run. Checks: every request that stayed gets
a 200 with a finish reason (streams end with `[DONE]`), nothing is lost or answered 5xx, the
pool's pages all come back, the drain finishes the running streams and the process exits 0.

Short by default (CI: two requests per client); PAGODA_SOAK_ROUNDS=N runs N per client."""

import json
import os
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from conftest import start_pagoda

CLIENTS = 64
ROUNDS = int(os.environ.get("PAGODA_SOAK_ROUNDS", "2"))
WORDS = ["river", "stone", "lamp", "cloud", "bread", "glass", "wind", "paper"]


def metric(url, name):
    text = requests.get(f"{url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} missing from /metrics")


def start_server():
    # 48 pages of 16 tokens for 16 sequences of up to ~80 tokens: preemption under load.
    return start_pagoda(["-c", "512", "-np", "16", "--kv-pages", "48", "--max-queue", "128",
                         "--shutdown-timeout", "60"], "soak")


def one_request(url, model, rng):
    """One request; returns (outcome, detail): 'ok', 'disconnected' or a failure."""
    chat = rng.random() < 0.5
    stream = rng.random() < 0.7
    disconnect = stream and rng.random() < 0.2
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 30)))
    common = {"model": model, "max_tokens": rng.randint(8, 48), "stream": stream,
              "temperature": 0.8, "seed": rng.randint(0, 1 << 30)}
    if chat:
        path = "/v1/chat/completions"
        body = {**common, "messages": [{"role": "user", "content": f"Repeat: {words}"}]}
    else:
        path = "/v1/completions"
        body = {**common, "prompt": f"A list: {words}"}
    with requests.post(url + path, json=body, stream=stream, timeout=300) as response:
        if response.status_code != 200:
            return "failed", f"{response.status_code} {response.text[:200]}"
        if not stream:
            finish = response.json()["choices"][0]["finish_reason"]
            return ("ok", "") if finish in ("stop", "length") else ("failed", f"finish {finish}")
        events = []
        for line in response.iter_lines(decode_unicode=True):
            if line.startswith("data: "):
                events.append(line[6:])
                if disconnect and len(events) == 3:
                    return "disconnected", ""
        if not events or events[-1] != "[DONE]":
            return "failed", f"stream ended without [DONE]: {events[-2:]}"
        chunks = [json.loads(e) for e in events[:-1]]
        if any("error" in c for c in chunks):
            return "failed", f"error event: {events[-2]}"
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
        if finishes[-1] not in ("stop", "length"):
            return "failed", f"last finish {finishes[-1]}"
        return "ok", ""


def test_soak_then_sigterm_drain():
    process, url = start_server()
    try:
        model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]

        def client(index):
            rng = random.Random(1000 + index)
            return [one_request(url, model, rng) for _ in range(ROUNDS)]

        started = time.time()
        with ThreadPoolExecutor(max_workers=CLIENTS) as pool:
            results = [r for rs in pool.map(client, range(CLIENTS)) for r in rs]
        elapsed = time.time() - started
        failures = [detail for outcome, detail in results if outcome == "failed"]
        assert not failures, f"{len(failures)} of {len(results)} failed: {failures[:5]}"
        done = sum(outcome == "ok" for outcome, _ in results)
        disconnected = len(results) - done
        preemptions = metric(url, "pagoda_preemptions_total")
        print(f"soak: {len(results)} requests ({done} answered, {disconnected} disconnected) "
              f"from {CLIENTS} clients in {elapsed:.1f} s, {preemptions:.0f} preemptions")
        assert preemptions > 0, "the pool never ran short: no preemption was exercised"
        deadline = time.time() + 30
        while metric(url, "pagoda_kv_pages_used") > 0 or metric(url, "pagoda_running_sequences") > 0:
            assert time.time() < deadline, "KV pages were not all returned after the soak"
            time.sleep(0.1)

        # SIGTERM while eight streams run: each still ends with its finish and [DONE].
        body = {"model": model, "prompt": "Count: one, two,", "max_tokens": 64,
                "ignore_eos": True, "stream": True}
        streams = [requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=120)
                   for _ in range(8)]
        lines = [s.iter_lines(decode_unicode=True) for s in streams]
        for it in lines:
            next(line for line in it if line.startswith("data: "))
        process.send_signal(signal.SIGTERM)
        outcomes = []

        def finish(it):
            events = [line[6:] for line in it if line.startswith("data: ")]
            last = json.loads(events[-2])["choices"][0]["finish_reason"] if len(events) > 1 else None
            outcomes.append((events[-1] if events else None, last))

        threads = [threading.Thread(target=finish, args=(it,)) for it in lines]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert outcomes == [("[DONE]", "length")] * 8, outcomes
        assert process.wait(timeout=60) == 0, "the drained server did not exit 0"
    finally:
        if process.poll() is None:
            process.kill()

"""A seeded request gives the same tokens alone, with the prefix cache cold and warm, under
load, and preempted (issue 43): byte for byte on the CPU backend, whose kernels are
batch-invariant by default. The preemption case runs on a second server with a KV pool too
small for its four concurrent requests."""

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from conftest import metric, start_pagoda
from test_api import skip_unless_batch_invariant

SAMPLING = dict(temperature=1.0, top_p=0.95, top_k=40, max_tokens=24)


def complete(base_url, headers, model, prompt, seed, **extra):
    body = {"model": model, "prompt": prompt, "seed": seed, "logprobs": 0, **SAMPLING, **extra}
    response = requests.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def long_prompt(nonce):
    # About 150 tokens, starting with a nonce so no earlier request shares its pages.
    return f"[{nonce}] Notes for the trip: " + "; ".join(
        f"day {i} we walk to the {p}" for i, p in enumerate(["lake", "hill", "town"] * 8))


def test_seeded_request_is_the_same_cold_warm_and_under_load(base_url, headers, model):
    skip_unless_batch_invariant(base_url, headers)
    prompt = long_prompt(uuid.uuid4().hex)
    cold = complete(base_url, headers, model, prompt, seed=4242)
    hits_before = metric(base_url, "pagoda_prefix_cache_hit_tokens_total")
    warm = complete(base_url, headers, model, prompt, seed=4242)
    assert metric(base_url, "pagoda_prefix_cache_hit_tokens_total") > hits_before, \
        "the second run should reuse the cached prefix"
    assert warm == cold
    others = [long_prompt(uuid.uuid4().hex) for _ in range(7)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        busy = [pool.submit(complete, base_url, headers, model, p, 900 + i)
                for i, p in enumerate(others)]
        loaded = pool.submit(complete, base_url, headers, model, prompt, 4242)
        for future in busy:
            future.result()
        assert loaded.result() == cold


@pytest.fixture(scope="module")
def small_pool_server():
    # 14 pages of 16 tokens: one request (about 40 prompt + 48 new tokens, 6 pages) fits,
    # four at once do not, so the scheduler preempts and recomputes.
    process, url = start_pagoda(["-c", "256", "-np", "4", "--kv-pages", "14"], "small-pool")
    yield url
    process.terminate()
    process.wait(timeout=30)


def test_seeded_requests_are_the_same_when_preempted(small_pool_server):
    url = small_pool_server
    model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    skip_unless_batch_invariant(url, {})
    prompts = [f"Story {i}: the old ship left the harbour at dawn and" for i in range(4)]
    extra = dict(max_tokens=48, ignore_eos=True)
    alone = [complete(url, {}, model, p, 31 + i, **extra) for i, p in enumerate(prompts)]
    before = metric(url, "pagoda_preemptions_total")
    with ThreadPoolExecutor(max_workers=4) as pool:
        together = list(pool.map(lambda i: complete(url, {}, model, prompts[i], 31 + i, **extra),
                                 range(4)))
    assert metric(url, "pagoda_preemptions_total") > before, "no request was preempted"
    assert together == alone

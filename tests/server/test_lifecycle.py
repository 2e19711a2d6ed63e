"""Disconnects free pages; bad input gets its status and an OpenAI error body."""

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import requests

from conftest import metric


def wait_for_pages_free(base_url, seconds=20):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if metric(base_url, "pagoda_kv_pages_used") == 0 and metric(base_url, "pagoda_running_sequences") == 0:
            return True
        time.sleep(0.1)
    return False


def test_disconnect_mid_stream_frees_pages(base_url, headers, model):
    assert wait_for_pages_free(base_url)
    cancelled_before = metric(base_url, "pagoda_requests_cancelled_total")
    # Greedy counting does not end by itself within max_tokens.
    body = {"model": model, "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 500,
            "temperature": 0, "stream": True}
    with requests.post(f"{base_url}/v1/completions", json=body, headers=headers, stream=True, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        received = 0
        for line in lines:
            if line.startswith(b"data: {"):
                received += 1
                if received == 3:
                    break
        assert metric(base_url, "pagoda_kv_pages_used") > 0
    # The connection is closed; the request is cancelled and its pages come back.
    assert wait_for_pages_free(base_url), "KV pages were not freed after the client disconnected"
    assert metric(base_url, "pagoda_requests_cancelled_total") >= cancelled_before + 1


def test_repeated_long_prompt_hits_the_prefix_cache(base_url, headers, model):
    # About 200 tokens: a dozen full 16-token pages the second request can share.
    prompt = "Here is a list of colours to remember carefully: " + ", ".join(
        f"colour {i} is {c}" for i, c in enumerate(["red", "green", "blue", "amber"] * 12))
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = requests.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=60)
    assert first.status_code == 200
    prompt_tokens = first.json()["usage"]["prompt_tokens"]
    assert prompt_tokens > 100
    hits_before = metric(base_url, "pagoda_prefix_cache_hit_tokens_total")
    second = requests.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=60)
    assert second.status_code == 200
    # Same greedy answer with and without the cached prefix.
    assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    hits = metric(base_url, "pagoda_prefix_cache_hit_tokens_total") - hits_before
    # Every full page but the one holding the last prompt token is shared (page size 16).
    assert hits == (prompt_tokens - 1) // 16 * 16, (hits, prompt_tokens)


def test_ignore_eos_generates_exactly_max_tokens(base_url, headers, model):
    body = {"model": model, "prompt": "Say hi.", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}
    response = requests.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 40
    assert response.json()["choices"][0]["finish_reason"] == "length"


def post(base_url, path, body, headers, raw=False):
    data = body if raw else json.dumps(body)
    return requests.post(f"{base_url}{path}", data=data,
                         headers={**headers, "Content-Type": "application/json"}, timeout=30)


def assert_error(response, status, param=None, contains=()):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error
    for text in contains:
        assert text in error["message"], error
    return error


CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


def test_malformed_json(base_url, headers):
    assert_error(post(base_url, CHAT, '{"messages": [', headers, raw=True), 400)


def test_wrong_field_types(base_url, headers, model):
    assert_error(post(base_url, CHAT, {"model": model, "messages": MESSAGES, "temperature": "hot"}, headers), 400, "temperature")
    assert_error(post(base_url, CHAT, {"model": model, "messages": "hi"}, headers), 400, "messages")
    assert_error(post(base_url, CHAT, {"model": model, "messages": MESSAGES, "stop": 5}, headers), 400, "stop")
    assert_error(post(base_url, CHAT, {"model": model, "messages": MESSAGES, "max_tokens": "ten"}, headers), 400, "max_tokens")


def test_unknown_model_is_404(base_url, headers):
    error = assert_error(post(base_url, CHAT, {"model": "gpt-17", "messages": MESSAGES}, headers), 404, "model")
    assert error["code"] == "model_not_found"


def test_empty_messages(base_url, headers, model):
    assert_error(post(base_url, CHAT, {"model": model, "messages": []}, headers), 400, "messages")


def test_unknown_roles_are_400(base_url, headers, model):
    for role in ["wizard", "", "User"]:
        body = {"model": model, "messages": [{"role": role, "content": "hi"}]}
        assert_error(post(base_url, CHAT, body, headers), 400, "messages", contains=("is not one of",))


def test_context_overflow_names_both_numbers(base_url, headers, model):
    response = post(base_url, "/v1/completions", {"model": model, "prompt": "hello there", "max_tokens": 5000}, headers)
    error = assert_error(response, 400, "max_tokens", contains=("5000", "1024"))
    assert error["code"] == "context_length_exceeded"


def test_negative_and_absurd_parameters(base_url, headers, model):
    for field, value in [("temperature", -1), ("temperature", 1e9), ("top_p", 0), ("top_p", 2),
                         ("top_k", -1), ("min_p", 3), ("max_tokens", 0), ("max_tokens", -5),
                         ("presence_penalty", 1e6), ("repeat_penalty", -1), ("n", 17), ("n", 0), ("top_logprobs", 99)]:
        body = {"model": model, "messages": MESSAGES, field: value}
        if field == "top_logprobs":
            body["logprobs"] = True
        assert_error(post(base_url, CHAT, body, headers), 400, field)


def test_oversized_body_is_413(base_url, headers, model):
    body = {"model": model, "prompt": "x" * (2 << 20)}
    assert_error(post(base_url, "/v1/completions", body, headers), 413)


def open_stream(base_url, headers, model):
    """Starts a long streaming request on a raw socket; returns (socket, status line)."""
    url = urlparse(base_url)
    body = json.dumps({"model": model, "prompt": "Tell me everything.", "max_tokens": 400, "stream": True})
    sock = socket.create_connection((url.hostname, url.port), timeout=30)
    auth = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}"
                  f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
    status = sock.recv(4096).split(b"\r\n", 1)[0].decode()
    return sock, status


def test_too_many_queued_requests_is_429(base_url, headers, model):
    # The test server runs 8 sequences and queues 16 more not yet admitted: a burst of 32
    # gets at least 17 answers (16 queued + at least one admitted) and some 429s.
    with ThreadPoolExecutor(max_workers=32) as pool:
        opened = list(pool.map(lambda _: open_stream(base_url, headers, model), range(32)))
    statuses = [status for _, status in opened]
    for sock, _ in opened:
        sock.close()
    assert any(" 429 " in s for s in statuses), statuses
    assert sum(" 200 " in s for s in statuses) >= 17, statuses
    assert all(" 200 " in s or " 429 " in s for s in statuses), statuses
    assert wait_for_pages_free(base_url, seconds=60)

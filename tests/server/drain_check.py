"""The real binary drains on SIGTERM (run last by scripts/test-server.sh, which then checks
the exit status; not collected with the other tests, since it stops the server): a running
stream finishes, /health turns 503 and new requests get 503 meanwhile, then the process
exits."""

import json
import os
import signal
import time

import requests


def test_sigterm_drains_the_running_stream_then_exits(base_url, headers, model):
    pid = int(os.environ["PAGODA_SERVER_PID"])
    body = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": 300,
        "stream": True,
        "ignore_eos": True,
    }
    stream = requests.post(
        f"{base_url}/v1/completions", json=body, headers=headers, stream=True, timeout=120
    )
    assert stream.status_code == 200, stream.text
    lines = stream.iter_lines(decode_unicode=True)
    first = next(line for line in lines if line.startswith("data: "))
    assert json.loads(first[6:])["choices"][0]["finish_reason"] is None

    os.kill(pid, signal.SIGTERM)
    health = None
    for _ in range(50):
        health = requests.get(f"{base_url}/health", timeout=10)
        if health.status_code == 503:
            break
        time.sleep(0.05)
    assert health.status_code == 503, health.text
    assert health.json()["status"] == "draining"
    refused = requests.post(
        f"{base_url}/v1/completions",
        json={"model": model, "prompt": "hi", "max_tokens": 2},
        headers=headers,
        timeout=10,
    )
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "shutting_down"

    events = [line[6:] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    finishes = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-1]]
    assert finishes[-1] == "length", events[-3:]
    # No event is an error object (the generated text may hold the word: "terror").
    assert all("error" not in json.loads(e) for e in events[:-1]), events[-3:]

    for _ in range(200):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError("the server did not exit after its drain")

"""Fixtures for the live-server tests; scripts/test-server.sh starts the server and sets
PAGODA_URL and PAGODA_API_KEY."""

import os
import socket
import subprocess
import time

import openai
import pytest
import requests


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_pagoda(args, name):
    """Starts `$PAGODA_BIN serve --port P *args` (no API key; PAGODA_SERVE_ARGS appended) and
    waits for /health; returns (process, url). Skips the test when PAGODA_BIN is not set."""
    binary = os.environ.get("PAGODA_BIN")
    if not binary:
        pytest.skip("PAGODA_BIN is not set; run bash scripts/test-server.sh")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "PAGODA_API_KEY"}
    command = [binary, "serve", "--port", str(port), *args,
               *os.environ.get("PAGODA_SERVE_ARGS", "").split()]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except requests.ConnectionError:
            pass
        assert process.poll() is None, f"the {name} server exited during start-up"
        time.sleep(0.2)
    process.kill()
    raise AssertionError(f"the {name} server did not become ready")


@pytest.fixture(scope="session")
def base_url():
    url = os.environ.get("PAGODA_URL")
    if not url:
        pytest.skip("PAGODA_URL is not set; run bash scripts/test-server.sh")
    return url


@pytest.fixture(scope="session")
def api_key():
    return os.environ.get("PAGODA_API_KEY", "")


@pytest.fixture(scope="session")
def headers(api_key):
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


@pytest.fixture(scope="session")
def client(base_url, api_key):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key or "none", max_retries=0)


@pytest.fixture(scope="session")
def model(base_url, headers):
    response = requests.get(f"{base_url}/v1/models", headers=headers, timeout=10)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def metric(base_url, name):
    """The value of an unlabelled metric from /metrics."""
    key = os.environ.get("PAGODA_API_KEY", "")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    text = requests.get(f"{base_url}/metrics", headers=headers, timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"metric {name} not found in /metrics")


@pytest.fixture(scope="session", autouse=True)
def record_bodies_for_fuzzing():
    """With PAGODA_FUZZ_SEEDS=DIR, every request body the suite sends (raw requests and the
    openai client) is saved there, named by its path: scripts/fuzz.sh seeds the fuzzer with
    them."""
    folder = os.environ.get("PAGODA_FUZZ_SEEDS")
    if not folder:
        yield
        return
    import hashlib
    import importlib

    os.makedirs(folder, exist_ok=True)

    def save(path, body):
        if not body:
            return
        if isinstance(body, str):
            body = body.encode()
        name = path.strip("/").replace("/", "_") + "-" + hashlib.sha1(body).hexdigest()[:16]
        with open(os.path.join(folder, name), "wb") as f:
            f.write(body)

    original_send = requests.Session.send

    def send(self, request, **kwargs):
        save(requests.utils.urlparse(request.url).path, request.body)
        return original_send(self, request, **kwargs)

    requests.Session.send = send
    patched = [(requests.Session, "send", original_send)]
    for module in ("httpx2", "httpx"):
        try:
            httpx = importlib.import_module(module)
        except ImportError:
            continue
        original = httpx.Client.send

        def client_send(self, request, *args, _original=original, **kwargs):
            save(request.url.path, request.read())
            return _original(self, request, *args, **kwargs)

        httpx.Client.send = client_send
        patched.append((httpx.Client, "send", original))
    yield
    for owner, name, original in patched:
        setattr(owner, name, original)

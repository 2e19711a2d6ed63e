"""API keys on every endpoint, keys from a file, no key in the log, and HTTPS with the official
client (scripts/test-server.sh starts both servers: --api-key-file with two keys, and a second
one with --ssl-cert-file/--ssl-key-file and a certificate made by rcgen)."""

import os
import ssl
import time

import openai
import pytest
import requests

ENDPOINTS = [
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
]


@pytest.fixture(scope="module")
def file_keys():
    path = os.environ.get("PAGODA_API_KEY_FILE")
    if not path:
        pytest.skip("PAGODA_API_KEY_FILE is not set; run bash scripts/test-server.sh")
    with open(path) as f:
        keys = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert len(keys) == 2, keys
    return keys


def send(base_url, method, path, body, authorization=None):
    headers = {"Authorization": authorization} if authorization is not None else {}
    return requests.request(method, f"{base_url}{path}", json=body, headers=headers, timeout=30)


def test_every_endpoint_is_refused_without_a_key_and_served_with_either(base_url, file_keys):
    for method, path, body in ENDPOINTS:
        refused = send(base_url, method, path, body)
        assert refused.status_code == 401, (path, refused.text)
        assert refused.json()["error"]["type"] == "authentication_error"
        for key in file_keys:
            for scheme in ("Bearer", "bearer"):
                served = send(base_url, method, path, body, f"{scheme} {key}")
                assert served.status_code == 200, (path, scheme, served.text)
    # Only the health probe and preflights are open.
    assert requests.get(f"{base_url}/health", timeout=10).status_code == 200
    assert requests.options(f"{base_url}/v1/models", timeout=10).status_code != 401
    assert requests.get(f"{base_url}/slots", timeout=10).status_code == 401


def test_wrong_keys_of_any_length_are_refused_alike(base_url, file_keys):
    key = file_keys[0]
    same_length = key[:-1] + ("x" if key[-1] != "x" else "y")
    answers = [send(base_url, "GET", "/v1/models", None, f"Bearer {wrong}")
               for wrong in (same_length, key[:3], key + "-longer", key.upper())]
    for answer in answers:
        assert answer.status_code == 401
        assert answer.json() == answers[0].json()


def test_refusals_are_logged_with_the_address_and_never_the_key(base_url, file_keys):
    log_path = os.environ.get("PAGODA_SERVER_LOG_FILE")
    if not log_path:
        pytest.skip("PAGODA_SERVER_LOG_FILE is not set; run bash scripts/test-server.sh")
    wrong = "wrong-key-" + str(os.getpid())
    send(base_url, "GET", "/v1/models", None, f"Bearer {wrong}")
    for key in file_keys:  # accepted requests: nothing about them may show the key either
        send(base_url, "GET", "/v1/models", None, f"Bearer {key}")
    time.sleep(0.2)
    with open(log_path) as f:
        log = f.read()
    refusals = [line for line in log.splitlines() if "refused GET /v1/models" in line]
    assert refusals and "127.0.0.1" in refusals[-1], log[-2000:]
    for secret in [wrong, *file_keys]:
        assert secret not in log


@pytest.fixture(scope="module")
def tls():
    url = os.environ.get("PAGODA_TLS_URL")
    if not url:
        pytest.skip("PAGODA_TLS_URL is not set (no HTTPS server); run bash scripts/test-server.sh")
    return url, os.environ["PAGODA_TLS_CA"]


def test_the_openai_client_works_over_https(tls, file_keys):
    url, ca = tls
    # The client's own HTTP client type, trusting the test's certificate.
    with openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=ca)) as http:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=file_keys[1], max_retries=0, http_client=http)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8, temperature=0)
        assert reply.choices[0].message.content
        chunks = list(client.completions.create(model=model, prompt="1, 2, 3,", max_tokens=4, stream=True))
        assert chunks
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0, http_client=http).models.list()


def test_https_needs_a_trusted_certificate_and_plain_http_fails_cleanly(tls):
    url, ca = tls
    with pytest.raises(requests.exceptions.SSLError):
        requests.get(f"{url}/health", timeout=10)  # the self-signed certificate is not trusted
    plain = url.replace("https://", "http://")
    started = time.time()
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(f"{plain}/health", timeout=10)
    assert time.time() - started < 5
    assert requests.get(f"{url}/health", verify=ca, timeout=10).status_code == 200

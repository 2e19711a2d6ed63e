"""Fixtures for the live-server tests; scripts/test-server.sh starts the server and sets
PAGODA_URL and PAGODA_API_KEY."""

import os

import openai
import pytest
import requests


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
    text = requests.get(f"{base_url}/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"metric {name} not found in /metrics")

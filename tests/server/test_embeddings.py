"""/v1/embeddings against an independent numpy forward pass of the served GGUF
(embedding_reference.py): mean-pooled, L2-normalised final hidden states, as llama-server's
`--embedding`."""

import base64
import os
import struct

import pytest
import requests

np = pytest.importorskip("numpy", reason="numpy is needed for the embedding oracle")
pytest.importorskip("gguf", reason="gguf is needed for the embedding oracle")

from embedding_reference import Reference  # noqa: E402

MODEL_PATH = os.environ.get("PAGODA_MODEL_PATH", "models/SmolLM2-135M-Instruct.Q4_1.gguf")
TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b"]


@pytest.fixture(scope="module")
def reference():
    if not os.path.exists(MODEL_PATH):
        pytest.skip(f"{MODEL_PATH} is missing")
    return Reference(MODEL_PATH)


def token_ids(base_url, headers, text):
    response = requests.post(
        f"{base_url}/tokenize", json={"content": text}, headers=headers, timeout=10
    )
    response.raise_for_status()
    return response.json()["tokens"]


def post(base_url, headers, body):
    return requests.post(f"{base_url}/v1/embeddings", json=body, headers=headers, timeout=60)


def test_embeddings_match_the_numpy_forward(client, model, base_url, headers, reference):
    # The official client asks for base64 by default and decodes it.
    answer = client.embeddings.create(model=model, input=TEXTS)
    assert [d.index for d in answer.data] == [0, 1]
    total = 0
    for text, item in zip(TEXTS, answer.data):
        ids = token_ids(base_url, headers, text)
        total += len(ids)
        expected = reference.embedding(ids)
        got = np.asarray(item.embedding, dtype=np.float64)
        assert got.shape == expected.shape
        assert abs(np.linalg.norm(got) - 1.0) < 1e-4
        cosine, worst = float(got @ expected), float(np.max(np.abs(got - expected)))
        print(f"{text!r}: cosine {cosine:.6f}, largest difference {worst:.2e}")
        assert cosine > 0.999 and worst < 2e-2, (cosine, worst)
    assert answer.usage.prompt_tokens == total
    assert answer.usage.total_tokens == total


def test_embedding_inputs_and_formats_agree(base_url, headers, model):
    text = TEXTS[0]
    ids = token_ids(base_url, headers, text)
    floats = post(base_url, headers, {"model": model, "input": text}).json()
    assert floats["object"] == "list" and floats["model"] == model
    vector = floats["data"][0]["embedding"]
    assert floats["data"][0]["object"] == "embedding"
    # Token ids give the same vector as the text they encode, alone or in a batch.
    by_ids = post(base_url, headers, {"input": ids}).json()["data"][0]["embedding"]
    batch = post(base_url, headers, {"input": [ids, TEXTS[1], text]}).json()["data"]
    assert by_ids == vector and batch[0]["embedding"] == vector and batch[2]["embedding"] == vector
    # base64 is the little-endian f32 bytes of the same numbers.
    raw = post(base_url, headers, {"input": text, "encoding_format": "base64"}).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(packed) // 4}f", packed)) == pytest.approx(vector, abs=0)


@pytest.mark.parametrize(
    "body, names",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": 5}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": [10**9]}, "vocabulary"),
        ({"input": "x " * 3000}, "context"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "dimensions": 8}, "dimensions"),
        ({}, "input"),
    ],
)
def test_bad_embedding_requests_are_400_naming_the_problem(base_url, headers, body, names):
    response = post(base_url, headers, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert names in error["message"] or names == error.get("param"), error

"""Structured output through the official openai client: response_format (the client's
`parse` helper with pydantic models, and raw JSON schemas), llama-server's and vLLM's
fields, streamed and not, greedy and at temperature 1. The oracle is `jsonschema`: every
answer that ends with finish_reason "stop" must parse and validate; answers are given room
enough (max_tokens) that all do."""

import json
from typing import List, Literal, Optional

import jsonschema
import openai
import pydantic
import pytest
import requests

from conftest import metric

# Schemas with nesting, enums, arrays, optional fields, anyOf, patterns and formats; every
# string and array bounded so a 135M model's answer ends well inside max_tokens.
SCHEMAS = {
    "flat": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested_enum_array": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 16},
            "weather": {"enum": ["sun", "rain", "snow"]},
            "days": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "day": {"type": "integer", "minimum": 1, "maximum": 31},
                        "ok": {"type": "boolean"},
                    },
                    "required": ["day", "ok"],
                    "additionalProperties": False,
                },
                "maxItems": 2,
            },
        },
        "required": ["city", "weather", "days"],
        "additionalProperties": False,
    },
    "optional_anyof_pattern": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
            "value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, {"type": "null"}]},
            "note": {"type": "string", "maxLength": 12},
            "day": {"type": "string", "format": "date"},
        },
        "required": ["id", "value", "day"],
        "additionalProperties": False,
    },
}

PROMPT = "Answer in JSON."
MAX_TOKENS = 200


def response_format(name):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def check(text, finish_reason, schema):
    assert finish_reason == "stop", f"the answer did not end within {MAX_TOKENS} tokens: {text!r}"
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_json_schema_answers_validate(client, model, name, temperature):
    for seed in range(3 if temperature else 1):
        response = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=MAX_TOKENS,
            temperature=temperature,
            seed=seed,
            response_format=response_format(name),
        )
        choice = response.choices[0]
        check(choice.message.content, choice.finish_reason, SCHEMAS[name])


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_streamed_json_schema_answers_validate(client, model, name):
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=7,
        response_format=response_format(name),
        stream=True,
    )
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    check(text, finish, SCHEMAS[name])


class Day(pydantic.BaseModel):
    day: int = pydantic.Field(ge=1, le=31)
    kind: Literal["work", "rest"]


class Plan(pydantic.BaseModel):
    title: str = pydantic.Field(max_length=16)
    days: List[Day] = pydantic.Field(max_length=2)
    note: Optional[str] = pydantic.Field(default=None, max_length=10)


def test_the_clients_parse_helper_gets_a_valid_model(client, model):
    for temperature in (0.0, 1.0):
        completion = client.beta.chat.completions.parse(
            model=model,
            messages=[{"role": "user", "content": "Plan two days."}],
            max_tokens=MAX_TOKENS,
            temperature=temperature,
            seed=1,
            response_format=Plan,
        )
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Plan), message.content


def test_json_object_mode_gives_an_object(client, model):
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=3,
        response_format={"type": "json_object"},
    )
    choice = response.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.message.content.lstrip().startswith("{")


def test_llama_server_and_vllm_fields(base_url, headers, model):
    def complete(extra):
        body = {"model": model, "prompt": "The answer:", "max_tokens": 40, "temperature": 1.0, "seed": 5}
        body.update(extra)
        response = requests.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]

    choice = complete({"json_schema": SCHEMAS["flat"]})
    check(choice["text"], choice["finish_reason"], SCHEMAS["flat"])
    choice = complete({"grammar": 'root ::= "yes" | "no" | "maybe"'})
    assert choice["text"] in ("yes", "no", "maybe") and choice["finish_reason"] == "stop"
    choice = complete({"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert len(choice["text"]) == 6 and choice["text"][3] == "-", choice["text"]
    choice = complete({"structured_outputs": {"choice": ["red", "green"]}})
    assert choice["text"] in ("red", "green")


def test_bad_schemas_and_grammars_are_400s(client, model, base_url, headers):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}},
        )
    assert "not" in str(error.value) and error.value.body["param"] == "response_format"
    bad = [
        ({"grammar": "root ::= missing"}, "grammar"),
        ({"guided_regex": "("}, "guided_regex"),
        ({"json_schema": {"type": "object"}, "grammar": 'root ::= "a"'}, "grammar"),
    ]
    for extra, param in bad:
        body = {"model": model, "prompt": "x", "max_tokens": 4, **extra}
        response = requests.post(f"{base_url}/v1/completions", json=body, headers=headers, timeout=30)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param, response.text


def test_constrained_and_free_requests_share_the_server(client, model, base_url):
    before = metric(base_url, "pagoda_constrained_requests_total")
    free = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0.0
    )
    constrained = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        response_format=response_format("flat"),
    )
    check(constrained.choices[0].message.content, constrained.choices[0].finish_reason, SCHEMAS["flat"])
    assert free.choices[0].message.content is not None
    assert metric(base_url, "pagoda_constrained_requests_total") == before + 1

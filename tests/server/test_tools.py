"""Tool calling through the official openai client, on servers of their own started with a
tool-capable chat template (`--chat-template-file`): the Hermes / Qwen2.5 convention
(`<tool_call>` JSON) and the Llama 3.1 one (a bare JSON call). The default model does not
call tools on its own, so the tests force calls (`tool_choice: "required"` or a named
function), where the point is the format and the constraint: every call's arguments must
parse and validate against its function's schema (`jsonschema`), streamed and not, greedy
and at temperature 1; `finish_reason` must be "tool_calls". The round trip sends the calls
and the tools' results back as `tool` messages."""

import json
from pathlib import Path

import jsonschema
import openai
import pydantic
import pytest
import requests

from conftest import start_pagoda
from test_structured import SCHEMAS

TEMPLATES = Path(__file__).parent / "templates"
MAX_TOKENS = 400

# One function per schema of the structured-output tests (nesting, enums, arrays, optional
# fields, anyOf, patterns, formats), and one without parameters.
TOOLS = [
    {"type": "function", "function": {"name": f"record_{name}", "description": f"Records a {name} item.",
                                      "parameters": schema}}
    for name, schema in sorted(SCHEMAS.items())
] + [{"type": "function", "function": {"name": "ping", "description": "Checks the service."}}]
SCHEMA_OF = {tool["function"]["name"]: tool["function"].get("parameters", {"type": "object"}) for tool in TOOLS}
PROMPT = "Record an item for me, then check the service."


def start_server(template):
    # PAGODA_SERVE_ARGS (appended by start_pagoda): the suite's extra flags (on the GPU machine,
    # `--device cuda` and random weights with the default model's tokenizer).
    return start_pagoda(["-c", "4096", "-np", "4", "--chat-template-file", str(TEMPLATES / template)],
                        template)


@pytest.fixture(scope="module", params=["hermes-tools.jinja", "llama3-tools.jinja"])
def tool_server(request):
    process, url = start_server(request.param)
    model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    yield openai.OpenAI(base_url=f"{url}/v1", api_key="none"), model, url
    process.terminate()
    process.wait(timeout=30)


def check_calls(calls, finish_reason, names=None):
    made = [call.function.name for call in calls or []]
    assert finish_reason == "tool_calls", \
        f"the answer did not end in a call within {MAX_TOKENS} tokens ({len(made)} calls: {made})"
    assert calls, "no tool calls"
    ids = set()
    for call in calls:
        assert call.type == "function"
        assert call.id.startswith("call_") and call.id not in ids
        ids.add(call.id)
        assert call.function.name in (names or SCHEMA_OF), call.function.name
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMA_OF[call.function.name],
                            format_checker=jsonschema.FormatChecker())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_calls_validate(tool_server, temperature):
    client, model, _ = tool_server
    # Greedy, the default model may repeat one call without end (bf16 on CUDA made 16
    # identical calls in 1000 tokens): one call when greedy; parallel calls at temperature 1.
    for seed in range(3 if temperature else 1):
        response = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], tools=TOOLS,
            tool_choice="required", parallel_tool_calls=bool(temperature),
            max_tokens=MAX_TOKENS, temperature=temperature, seed=seed)
        choice = response.choices[0]
        check_calls(choice.message.tool_calls, choice.finish_reason)
        assert choice.message.content is None


@pytest.mark.parametrize("name", sorted(SCHEMA_OF))
def test_a_named_function_is_called_with_valid_arguments(tool_server, name):
    client, model, _ = tool_server
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": name}},
        max_tokens=MAX_TOKENS, temperature=1.0, seed=3)
    choice = response.choices[0]
    check_calls(choice.message.tool_calls, choice.finish_reason, names=[name])
    assert len(choice.message.tool_calls) == 1


def test_streamed_calls_carry_argument_deltas(tool_server):
    client, model, _ = tool_server
    for seed in range(2):
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], tools=TOOLS,
            tool_choice="required", max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, stream=True)
        calls, finish, argument_chunks = {}, None, 0
        for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            finish = chunk.choices[0].finish_reason or finish
            for part in delta.tool_calls or []:
                if part.id:
                    assert part.index not in calls, "a call started twice"
                    assert part.function.name and part.type == "function"
                    calls[part.index] = {"id": part.id, "name": part.function.name, "arguments": ""}
                elif part.function and part.function.arguments:
                    calls[part.index]["arguments"] += part.function.arguments
                    argument_chunks += 1
        assert sorted(calls) == list(range(len(calls)))
        assert argument_chunks > len(calls), "the arguments came in one piece, not streamed"
        parsed = [openai.types.chat.ChatCompletionMessageToolCall(
            id=c["id"], type="function", function={"name": c["name"], "arguments": c["arguments"]})
            for c in calls.values()]
        check_calls(parsed, finish)


def test_one_call_without_parallel_calls(tool_server):
    client, model, _ = tool_server
    for seed in range(3):
        response = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], tools=TOOLS,
            tool_choice="required", parallel_tool_calls=False, max_tokens=MAX_TOKENS,
            temperature=1.0, seed=seed)
        choice = response.choices[0]
        check_calls(choice.message.tool_calls, choice.finish_reason)
        assert len(choice.message.tool_calls) == 1


class Lookup(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=16)
    days: int = pydantic.Field(ge=1, le=7)


def test_the_clients_pydantic_tool_is_parsed(tool_server):
    client, model, _ = tool_server
    completion = client.beta.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "Weather in Oslo for 3 days?"}],
        tools=[openai.pydantic_function_tool(Lookup)], tool_choice="required",
        max_tokens=MAX_TOKENS, temperature=1.0, seed=5)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert isinstance(choice.message.tool_calls[0].function.parsed_arguments, Lookup)


def test_round_trip_with_tool_results(tool_server):
    client, model, url = tool_server
    first = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "ping"}}, max_tokens=MAX_TOKENS,
        temperature=0.0)
    call = first.choices[0].message.tool_calls[0]
    messages = [
        {"role": "user", "content": PROMPT},
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "{\"status\": \"pong-7781\"}"},
    ]
    # The template shows the call and the result to the model.
    prompt = requests.post(f"{url}/apply-template", json={"messages": messages, "tools": TOOLS},
                           timeout=30).json()["prompt"]
    assert "pong-7781" in prompt and '"ping"' in prompt
    second = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=32,
        temperature=0.0)
    choice = second.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)


def test_auto_answers_are_text_or_valid_calls(tool_server):
    client, model, _ = tool_server
    for seed in range(3):
        response = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": PROMPT}], tools=TOOLS,
            max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
        choice = response.choices[0]
        if choice.message.tool_calls:
            check_calls(choice.message.tool_calls, choice.finish_reason)
        else:
            assert choice.finish_reason in ("stop", "length")
            assert isinstance(choice.message.content, str)


def test_bad_tool_requests_are_400s(tool_server):
    _, model, url = tool_server

    def status(**body):
        body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **body}
        response = requests.post(f"{url}/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 400, response.text
        return response.json()["error"]

    assert status(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})["param"] == "tool_choice"
    assert status(tools=[{"type": "function", "function": {"name": "bad name"}}])["param"] == "tools"
    assert status(tool_choice="required")["param"] == "tool_choice"
    assert status(tools=TOOLS, response_format={"type": "json_object"})["param"] == "response_format"
    unsupported = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"not": {"type": "string"}}}}}}]
    error = status(tools=unsupported, tool_choice="required")
    assert "not" in error["message"]


def test_a_template_without_tools_refuses_them(base_url, headers, model):
    # The suite's main server renders the default model's template, which shows no tools.
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    response = requests.post(f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools" and "--chat-template-file" in error["message"]

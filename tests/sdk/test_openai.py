"""The OpenAI Python SDK against `kapitsa serve`."""

import json

import jsonschema
import openai
import pytest

from conftest import TOOL_SYSTEM, WEATHER_SCHEMA, final_answer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather of a city.",
            "parameters": WEATHER_SCHEMA,
        },
    }
]

QUESTION = [{"role": "user", "content": "What is 2+2? Answer with just the number."}]


def test_models(openai_client, model):
    ids = [m.id for m in openai_client.models.list().data]
    assert ids == [model]
    assert openai_client.models.retrieve(model).id == model


def test_chat(openai_client, model):
    r = openai_client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=16)
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert "4" in c.message.content, c.message.content
    assert c.finish_reason == "stop"
    assert not c.message.tool_calls
    assert r.usage.prompt_tokens > 10
    assert 0 < r.usage.completion_tokens <= 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streaming(openai_client, model):
    want = openai_client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=16)
    stream = openai_client.chat.completions.create(
        model=model,
        messages=QUESTION,
        temperature=0,
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage, n = "", None, None, 0
    for chunk in stream:
        n += 1
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert n >= 3
    assert text == want.choices[0].message.content
    assert finish == "stop"
    assert usage.completion_tokens == want.usage.completion_tokens
    # The same prompt again: its prefix is served from the cache.
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_chat_options(openai_client, model):
    r = openai_client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}],
        temperature=0.8,
        top_p=0.9,
        seed=7,
        n=2,
        max_completion_tokens=8,
        logprobs=True,
        top_logprobs=2,
        presence_penalty=0.5,
        stop=["\n\n"],
    )
    assert len(r.choices) == 2
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.logprobs.content, c
        for t in c.logprobs.content:
            assert t.logprob <= 0
            assert len(t.top_logprobs) == 2
    again = openai_client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}],
        temperature=0.8,
        top_p=0.9,
        seed=7,
        n=2,
        max_completion_tokens=8,
        presence_penalty=0.5,
        stop=["\n\n"],
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


WEATHER_QUESTION = [
    {"role": "system", "content": TOOL_SYSTEM},
    {"role": "user", "content": "What's the weather like in Paris right now?"},
]


def _call_weather(openai_client, model, stream, tool_choice="auto"):
    kwargs = dict(
        model=model,
        messages=WEATHER_QUESTION,
        tools=TOOLS,
        tool_choice=tool_choice,
        temperature=0,
        max_tokens=128,
    )
    if not stream:
        r = openai_client.chat.completions.create(**kwargs)
        return r.choices[0].message.content, r.choices[0].message.tool_calls, r.choices[0].finish_reason
    content, calls, finish = "", [], None
    for chunk in openai_client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            calls.extend(c.delta.tool_calls or [])
            finish = c.finish_reason or finish
    return content, calls, finish


def _check_call(content, calls, finish):
    assert calls, f"the model did not call the tool; it answered: {content!r}"
    assert "<tool_call>" not in (content or "")
    assert len(calls) == 1, calls
    call = calls[0]
    assert call.id and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER_SCHEMA)
    assert "paris" in args["city"].lower()
    assert finish == "tool_calls"
    return call


def test_tool_call_round_trip(openai_client, model):
    content, calls, finish = _call_weather(openai_client, model, stream=False)
    call = _check_call(content, calls, finish)
    r = openai_client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": TOOL_SYSTEM},
            {"role": "user", "content": "What's the weather like in Paris right now?"},
            {
                "role": "assistant",
                "content": content,
                "tool_calls": [
                    {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 22, "sky": "sunny"})},
        ],
        tools=TOOLS,
        temperature=0,
        max_tokens=64,
    )
    c = r.choices[0]
    final_answer(c.message.content, bool(c.message.tool_calls), c.finish_reason, "stop")


def test_tool_call_streaming(openai_client, model):
    content, calls, finish = _call_weather(openai_client, model, stream=True)
    _check_call(content, calls, finish)
    assert calls[0].index == 0 and calls[0].type == "function"


def test_tool_choice_required_then_none(openai_client, model):
    """tool_choice "required" makes the call by constrained decoding (only a tool call in the
    model's format, arguments valid under the schema), tool_choice "none" makes the answer
    after the tool result text: no call, no call markup."""
    content, calls, finish = _call_weather(openai_client, model, stream=False, tool_choice="required")
    assert not content, content
    call = _check_call(content, calls, finish)
    r = openai_client.chat.completions.create(
        model=model,
        messages=WEATHER_QUESTION
        + [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}
                ],
            },
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 22, "sky": "sunny"})},
        ],
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=64,
    )
    c = r.choices[0]
    assert not c.message.tool_calls, c.message
    assert c.finish_reason == "stop", c
    text = c.message.content
    assert "<tool_call>" not in text and "get_weather" not in text, text
    assert "22" in text or "sunny" in text.lower(), text


def test_tool_choice_named_function_streaming(openai_client, model):
    content, calls, finish = _call_weather(
        openai_client, model, stream=True, tool_choice={"type": "function", "function": {"name": "get_weather"}}
    )
    assert not content, content
    _check_call(content, calls, finish)
    assert calls[0].index == 0 and calls[0].type == "function"


def test_completions(openai_client, model):
    r = openai_client.completions.create(model=model, prompt="def fibonacci(n):", max_tokens=24, temperature=0)
    text = r.choices[0].text
    assert text.strip(), r
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 24
    streamed = ""
    for chunk in openai_client.completions.create(
        model=model, prompt="def fibonacci(n):", max_tokens=24, temperature=0, stream=True
    ):
        streamed += chunk.choices[0].text if chunk.choices else ""
    assert streamed == text


def test_errors(openai_client, model, base_url):
    # Any model name is served by the one model (no --strict-model-name).
    r = openai_client.chat.completions.create(model="no-such-model", messages=QUESTION, max_tokens=2)
    assert r.choices[0].message is not None
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model=model, messages=QUESTION, temperature=5)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(
            model=model,
            messages=QUESTION,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}},
        )
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(
            model=model, messages=QUESTION, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}
        )
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model=model, messages=QUESTION, tool_choice="required")
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello " * 6000}])
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        openai_client.completions.create(model=model, prompt="x", max_tokens=0)
    # a body over the server's limit (--max-body-bytes, 64 MiB by default to hold base64 images)
    with pytest.raises(openai.APIStatusError) as e:
        openai_client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x" * (65 << 20)}])
    assert e.value.status_code == 413
    bad = openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=model, messages=QUESTION)
    # The server still works.
    assert openai_client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=4).choices


PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}

PERSON_PROMPT = [
    {
        "role": "user",
        "content": "Describe a fictional programmer named Ada, aged 36, who knows Rust and C, as JSON.",
    }
]


def test_json_schema(openai_client, model):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON_SCHEMA}}
    r = openai_client.chat.completions.create(
        model=model, messages=PERSON_PROMPT, temperature=0, max_tokens=200, response_format=fmt
    )
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    data = json.loads(c.message.content)
    jsonschema.validate(data, PERSON_SCHEMA)
    # Streaming gives the same JSON.
    text = ""
    for chunk in openai_client.chat.completions.create(
        model=model, messages=PERSON_PROMPT, temperature=0, max_tokens=200, response_format=fmt, stream=True
    ):
        for ch in chunk.choices:
            text += ch.delta.content or ""
    assert text == c.message.content
    # Sampled replies are valid too.
    r = openai_client.chat.completions.create(
        model=model, messages=PERSON_PROMPT, temperature=1.0, seed=3, n=3, max_tokens=300, response_format=fmt
    )
    for c in r.choices:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), PERSON_SCHEMA)
        else:
            assert c.finish_reason == "length", c


def test_json_object(openai_client, model):
    r = openai_client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give the capital of France as a JSON object with key 'capital'."}],
        temperature=0,
        max_tokens=100,
        response_format={"type": "json_object"},
    )
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    assert isinstance(json.loads(c.message.content), dict), c.message.content


def test_json_schema_parse_helper(openai_client, model):
    """The SDK's `parse` helper (pydantic model -> strict json_schema) round-trips."""
    pydantic = pytest.importorskip("pydantic")

    class City(pydantic.BaseModel):
        name: str
        country: str

    r = openai_client.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Name a large city in Japan."}],
        temperature=0,
        max_tokens=100,
        response_format=City,
    )
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.name and city.country, r


def _post(base_url, api_key, path, body):
    import urllib.request

    req = urllib.request.Request(
        base_url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def test_logit_bias_and_tokenize(openai_client, model, base_url, api_key):
    prompt = "def fibonacci(n):"
    ids = _post(base_url, api_key, "/tokenize", {"prompt": prompt, "add_special_tokens": False})["tokens"]
    assert _post(base_url, api_key, "/detokenize", {"tokens": ids})["prompt"] == prompt
    free = openai_client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0, logprobs=1)
    first = free.choices[0].logprobs.tokens[0]
    first_ids = _post(base_url, api_key, "/tokenize", {"prompt": first, "add_special_tokens": False})["tokens"]
    assert len(first_ids) == 1, (first, first_ids)
    # The greedy token banned: the choice moves to another token.
    banned = openai_client.completions.create(
        model=model, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, logit_bias={str(first_ids[0]): -100}
    )
    assert banned.choices[0].logprobs.tokens[0] != first
    # Steered to one word: every generated token is that word.
    word = _post(base_url, api_key, "/tokenize", {"prompt": " banana", "add_special_tokens": False})["tokens"]
    assert len(word) == 1
    steered = openai_client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=6, temperature=0, logit_bias={str(word[0]): 100}
    )
    # (chat content starts after the reply's leading whitespace)
    assert steered.choices[0].message.content.split() == ["banana"] * 6
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model=model, prompt=prompt, max_tokens=1, logit_bias={"99999999": 1})
    assert e.value.body["param"] == "logit_bias"


def test_responses(openai_client, model):
    r = openai_client.responses.create(
        model=model, input=QUESTION[0]["content"], instructions="Be brief.", temperature=0, max_output_tokens=16
    )
    assert r.status == "completed"
    assert "4" in r.output_text, r.output_text
    assert r.usage.input_tokens > 10 and 0 < r.usage.output_tokens <= 16
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_responses_streaming(openai_client, model):
    want = openai_client.responses.create(model=model, input=QUESTION, temperature=0, max_output_tokens=16)
    events = list(
        openai_client.responses.create(model=model, input=QUESTION, temperature=0, max_output_tokens=16, stream=True)
    )
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed", types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == want.output_text
    assert events[-1].response.output_text == want.output_text
    assert events[-1].response.usage.output_tokens == want.usage.output_tokens


def test_responses_tool_call_round_trip(openai_client, model):
    tools = [{"type": "function", "name": "get_weather", "description": "Get the current weather of a city.", "parameters": WEATHER_SCHEMA}]
    ask = [{"role": "system", "content": TOOL_SYSTEM}, {"role": "user", "content": "What is the weather in Paris?"}]
    r = openai_client.responses.create(model=model, input=ask, tools=tools, tool_choice="required", temperature=0, max_output_tokens=64)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather", r.output
    assert "city" in json.loads(calls[0].arguments)
    follow = ask + [
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 22 C"},
    ]
    r = openai_client.responses.create(model=model, input=follow, tools=tools, temperature=0, max_output_tokens=48)
    called_again = any(o.type == "function_call" for o in r.output)
    final_answer(r.output_text, called_again, r.status, "completed")


def test_responses_json_schema(openai_client, model):
    r = openai_client.responses.create(
        model=model,
        input=PERSON_PROMPT,
        text={"format": {"type": "json_schema", "name": "person", "strict": True, "schema": PERSON_SCHEMA}},
        temperature=0,
        max_output_tokens=200,
    )
    jsonschema.validate(json.loads(r.output_text), PERSON_SCHEMA)


def test_responses_errors(openai_client, model):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.responses.create(model=model, input="hi", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.responses.create(model=model, input=[{"type": "item_reference", "id": "msg_1"}])
    assert e.value.body["param"] == "input[0].type"
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.responses.create(model=model, input="hi", tools=[{"type": "function", "name": "f", "parameters": "x"}])
    assert e.value.body["param"] == "tools[0].parameters"


def test_embeddings(openai_client, model):
    # The SDK asks for base64 and decodes it.
    r = openai_client.embeddings.create(model=model, input=["def add(a, b): return a + b", "The weather is sunny."])
    assert [d.index for d in r.data] == [0, 1]
    for d in r.data:
        assert len(d.embedding) == 896
        assert abs(sum(x * x for x in d.embedding) - 1.0) < 1e-3
    assert r.usage.prompt_tokens > 5
    f = openai_client.embeddings.create(model=model, input="def add(a, b): return a + b", encoding_format="float")
    assert max(abs(a - b) for a, b in zip(f.data[0].embedding, r.data[0].embedding)) < 1e-4
    with pytest.raises(openai.BadRequestError):
        openai_client.embeddings.create(model=model, input=[])


def test_completions_suffix(openai_client, model):
    r = openai_client.completions.create(
        model=model, prompt="def fibonacci(n):\n    ", suffix="\n\nprint(fibonacci(10))\n", max_tokens=48, temperature=0
    )
    text = r.choices[0].text
    assert "return" in text or "if" in text, text
    assert "<|fim" not in text

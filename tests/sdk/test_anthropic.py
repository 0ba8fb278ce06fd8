"""The Anthropic Python SDK against `kapitsa serve`.

Recent SDKs (2.x) no longer take `temperature` as an argument; the server still accepts the
field, so it is sent with `extra_body`."""

import anthropic
import jsonschema
import pytest

from conftest import TOOL_SYSTEM, WEATHER_SCHEMA, final_answer

TOOLS = [{"name": "get_weather", "description": "Get the current weather of a city.", "input_schema": WEATHER_SCHEMA}]
ASK = [{"role": "user", "content": "What's the weather like in Paris right now?"}]


def test_messages(anthropic_client, model):
    m = anthropic_client.messages.create(
        model=model,
        max_tokens=16,
        extra_body={"temperature": 0},
        system="Answer with just the number.",
        messages=[{"role": "user", "content": "What is 2+2?"}],
    )
    assert m.type == "message" and m.role == "assistant"
    assert m.content[0].type == "text"
    assert "4" in m.content[0].text
    assert m.stop_reason == "end_turn"
    assert m.usage.input_tokens > 5 and 0 < m.usage.output_tokens <= 16
    n = anthropic_client.messages.count_tokens(
        model=model, system="Answer with just the number.", messages=[{"role": "user", "content": "What is 2+2?"}]
    )
    assert n.input_tokens == m.usage.input_tokens


def test_messages_max_tokens_and_stop(anthropic_client, model):
    m = anthropic_client.messages.create(
        model=model, max_tokens=3, extra_body={"temperature": 0}, messages=[{"role": "user", "content": "Count from 1 to 20, comma-separated."}]
    )
    assert m.stop_reason == "max_tokens"
    m = anthropic_client.messages.create(
        model=model,
        max_tokens=64,
        extra_body={"temperature": 0},
        stop_sequences=["5"],
        messages=[{"role": "user", "content": "Count from 1 to 20, comma-separated."}],
    )
    assert m.stop_reason == "stop_sequence", m
    assert m.stop_sequence == "5"
    assert "5" not in m.content[0].text


def _stream_call(anthropic_client, model):
    events = []
    with anthropic_client.messages.stream(
        model=model, max_tokens=128, extra_body={"temperature": 0}, system=TOOL_SYSTEM, tools=TOOLS, messages=ASK
    ) as stream:
        for ev in stream:
            events.append(ev.type)
        final = stream.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    texts = "".join(b.text for b in final.content if b.type == "text")
    assert uses, f"the model did not call the tool; it answered: {texts!r}"
    return events, final, uses[0]


def test_streaming_with_tool(anthropic_client, model):
    events, final, use = _stream_call(anthropic_client, model)
    assert events[0] == "message_start"
    assert events[-1] == "message_stop"
    assert "message_delta" in events and "content_block_stop" in events
    assert "input_json" in events
    assert "<tool_call>" not in "".join(b.text for b in final.content if b.type == "text")
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    assert "paris" in use.input["city"].lower()
    assert final.stop_reason == "tool_use"
    assert final.usage.output_tokens > 0


def test_tool_round_trip(anthropic_client, model):
    _, final, use = _stream_call(anthropic_client, model)
    m = anthropic_client.messages.create(
        model=model,
        max_tokens=64,
        extra_body={"temperature": 0},
        system=TOOL_SYSTEM,
        tools=TOOLS,
        messages=ASK
        + [
            {"role": "assistant", "content": [b.model_dump() for b in final.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "22 degrees Celsius, sunny"}],
            },
        ],
    )
    answer = "".join(b.text for b in m.content if b.type == "text")
    final_answer(answer, any(b.type == "tool_use" for b in m.content), m.stop_reason, "end_turn")


def test_tool_choice_any_then_none(anthropic_client, model):
    """tool_choice {"type": "any"} makes the call by constrained decoding, {"type": "none"}
    makes the answer after the tool result text."""
    m = anthropic_client.messages.create(
        model=model,
        max_tokens=128,
        extra_body={"temperature": 0},
        system=TOOL_SYSTEM,
        tools=TOOLS,
        tool_choice={"type": "any"},
        messages=ASK,
    )
    assert m.stop_reason == "tool_use", m
    assert [b.type for b in m.content] == ["tool_use"], m.content
    use = m.content[0]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    assert "paris" in use.input["city"].lower()
    m = anthropic_client.messages.create(
        model=model,
        max_tokens=64,
        extra_body={"temperature": 0},
        system=TOOL_SYSTEM,
        tools=TOOLS,
        tool_choice={"type": "none"},
        messages=ASK
        + [
            {"role": "assistant", "content": [b.model_dump() for b in m.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "22 degrees Celsius, sunny"}],
            },
        ],
    )
    assert m.stop_reason == "end_turn", m
    assert all(b.type == "text" for b in m.content), m.content
    answer = "".join(b.text for b in m.content)
    assert "<tool_call>" not in answer and "get_weather" not in answer, answer
    assert "22" in answer or "sunny" in answer.lower(), answer


def test_tool_choice_named_tool_streaming(anthropic_client, model):
    with anthropic_client.messages.stream(
        model=model,
        max_tokens=128,
        extra_body={"temperature": 0},
        system=TOOL_SYSTEM,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=ASK,
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["tool_use"], final.content
    jsonschema.validate(final.content[0].input, WEATHER_SCHEMA)


def test_errors(anthropic_client, model, base_url):
    # Any model name is served by the one model (no --strict-model-name).
    assert anthropic_client.messages.create(model="claude-nope", max_tokens=2, messages=ASK).type == "message"
    with pytest.raises(anthropic.BadRequestError) as e:
        anthropic_client.messages.create(model=model, max_tokens=8, extra_body={"temperature": 1.5}, messages=ASK)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        anthropic_client.messages.create(
            model=model, max_tokens=8, tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}, messages=ASK
        )
    with pytest.raises(anthropic.BadRequestError):
        anthropic_client.messages.create(model=model, max_tokens=8, tool_choice={"type": "any"}, messages=ASK)
    with pytest.raises(anthropic.BadRequestError):
        anthropic_client.messages.create(model=model, max_tokens=8, messages=[{"role": "user", "content": "hello " * 6000}])
    bad = anthropic.Anthropic(base_url=base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=model, max_tokens=8, messages=ASK)

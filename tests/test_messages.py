"""/v1/messages (Anthropic's Messages API) on `tiny`, through the official `anthropic` client.

References: the chat endpoint answering the same conversation (itself pinned to a fresh full
prefill in test_server.py), `fresh_answer` (a full prefill, no cache), and the renderer's
boundaries for how much a continued conversation restores.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from helpers import SERVER_WINDOW
from test_server import fresh_answer, prompt_of

from engine.serving import messages as api
from engine.serving.completion import ApiError, parse_request
from engine.serving.server import BackgroundServer, ServerConfig
from engine.turn import ToolCall, Turn, TurnStats

WINDOW = SERVER_WINDOW
MAX_TOKENS = 5
GREEDY = {"temperature": 0, "presence_penalty": 0}  # not in the client's signature: extra_body
TOOLS = [{"name": "get_weather", "description": "Weather for a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}]  # fmt: skip
CHAT_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                 "parameters": t["input_schema"]}} for t in TOOLS]  # fmt: skip


def client(srv, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0, timeout=60)


def ask(c: anthropic.Anthropic, messages: list, **kw):
    kw = {"max_tokens": MAX_TOKENS, "extra_body": GREEDY, **kw}
    return c.messages.create(model="tiny", messages=messages, **kw)


def chat(srv, messages: list, **kw):
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    return c.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                     **GREEDY, **kw)  # fmt: skip


def text(m) -> str:
    return "".join(b.text for b in m.content if b.type == "text")


def test_plain_and_streamed_equal_the_chat_endpoint(tiny, server):
    c = client(server)
    conversation = [{"role": "user", "content": "Tell me about foxes."}]
    m = ask(c, conversation, system="You are terse.")
    reference = chat(server, [{"role": "system", "content": "You are terse."}, *conversation])
    assert m.type == "message" and m.role == "assistant"
    assert text(m) == reference.choices[0].message.content
    assert text(m) == fresh_answer(tiny, [{"role": "system", "content": "You are terse."},
                                          *conversation], MAX_TOKENS)  # fmt: skip
    assert m.stop_reason == "max_tokens"
    u = m.usage
    assert u.input_tokens + u.cache_read_input_tokens == reference.usage.prompt_tokens
    assert u.output_tokens == MAX_TOKENS
    # The system prompt as text blocks renders the same; the stream adds up to the message.
    system = [{"type": "text", "text": "You are terse."}]
    with c.messages.stream(model="tiny", messages=conversation, system=system,
                           max_tokens=MAX_TOKENS, extra_body=GREEDY) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_delta" in kinds and "message_delta" in kinds
    assert text(final) == text(m)
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == MAX_TOKENS
    # Everything before the answer was cached by the first request.
    assert (
        final.usage.cache_read_input_tokens
        == prompt_of(
            tiny, [{"role": "system", "content": "You are terse."}, *conversation]
        ).boundaries.generation_start
    )


def test_multi_turn_reuses_like_chat(tiny, server):
    c = client(server)
    system = "Three turns, resent in full."
    turns, chat_messages = [], [{"role": "system", "content": system}]
    previous = None
    for k in range(3):
        turns.append({"role": "user", "content": f"Question {k}: what is {k * 13}?"})
        chat_messages.append(turns[-1])
        m = ask(c, turns, system=system)
        prompt = prompt_of(tiny, chat_messages)
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(prompt.ids)
        if previous is not None:
            assert m.usage.cache_read_input_tokens == previous.boundaries.generation_start
        assert text(m) == fresh_answer(tiny, chat_messages, MAX_TOKENS)
        turns.append({"role": "assistant", "content": text(m)})
        chat_messages.append(turns[-1])
        previous = prompt


def test_consecutive_user_turns_are_one_turn(tiny, server):
    """As Anthropic combines them: the texts joined by a newline, as blocks of one message."""
    m = ask(client(server), [{"role": "user", "content": "Hello."},
                             {"role": "user", "content": [{"type": "text", "text": "Foxes?"}]}])  # fmt: skip
    one = [{"role": "user", "content": "Hello.\nFoxes?"}]
    assert text(m) == fresh_answer(tiny, one, MAX_TOKENS)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(prompt_of(tiny, one).ids)


def test_a_prefilled_answer_is_refused_naming_it(server):
    body = {"model": "tiny", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]}  # fmt: skip
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert "messages[1]" in r.json()["error"]["message"] and "prefill" in r.text


def test_tool_round_trip_renders_as_chat(tiny, server):
    c = client(server)
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": '{"temp_c": 21}'},
        ]},
    ]  # fmt: skip
    m = ask(c, conversation, tools=TOOLS)
    chat_messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [{"id": "call_1",
         "type": "function", "function": {"name": "get_weather",
                                          "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    ]  # fmt: skip
    reference = chat(server, chat_messages, tools=CHAT_TOOLS)
    assert text(m) == reference.choices[0].message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == reference.usage.prompt_tokens
    assert text(m) == fresh_answer(tiny, chat_messages, MAX_TOKENS, tools=CHAT_TOOLS)


def test_count_tokens_is_the_prompt_a_request_prefills(tiny, server):
    c = client(server)
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": '{"temp_c": 21}'},
        ]},
    ]  # fmt: skip
    counted = c.messages.count_tokens(model="tiny", messages=conversation, tools=TOOLS,
                                      system="Be brief.")  # fmt: skip
    chat_messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    ]  # fmt: skip
    assert counted.input_tokens == len(prompt_of(tiny, chat_messages, tools=CHAT_TOOLS).ids)
    m = ask(c, conversation, tools=TOOLS, system="Be brief.")
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted.input_tokens
    # A conversation past the context window is counted (a client asks how much to trim),
    # though /v1/messages refuses it.
    long = [{"role": "user", "content": "word " * (SERVER_WINDOW + 100)}]
    assert c.messages.count_tokens(model="tiny", messages=long).input_tokens > SERVER_WINDOW
    with pytest.raises(anthropic.BadRequestError):
        ask(c, long)
    # Checked as a Messages request is (no max_tokens needed), errors in Anthropic's shape.
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.count_tokens(model="tiny", messages=[{"role": "robot", "content": "hi"}])
    assert "messages[0].role" in e.value.body["error"]["message"]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_tool_use_validates_against_the_input_schema(server, choice):
    import jsonschema

    # An enum, so that random weights at temperature 1 finish the call within max_tokens.
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
              "required": ["city"]}  # fmt: skip
    tools = [{**TOOLS[0], "input_schema": schema}]
    c = client(server)
    m = ask(c, [{"role": "user", "content": "Weather in Paris?"}], tools=tools,
            tool_choice=choice, max_tokens=64, extra_body={"temperature": 1, "seed": 3})  # fmt: skip
    calls = [b for b in m.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and m.stop_reason == "tool_use"
    jsonschema.validate(calls[0].input, schema)


def test_thinking_blocks(tiny, server):
    c = client(server)
    conversation = [{"role": "user", "content": "Think first: 2+2?"}]
    m = ask(c, conversation, thinking={"type": "enabled", "budget_tokens": 1024})
    reference = chat(server, conversation,
                     extra_body={"chat_template_kwargs": {"enable_thinking": True}})  # fmt: skip
    # Five random tokens never close the think block: all of it is thinking.
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == reference.choices[0].message.reasoning_content
    events = list(ask(c, conversation, thinking={"type": "enabled", "budget_tokens": 1024},
                      stream=True))  # fmt: skip
    streamed = "".join(e.delta.thinking for e in events
                       if e.type == "content_block_delta" and e.delta.type == "thinking_delta")  # fmt: skip
    assert streamed == m.content[0].thinking
    off = ask(c, conversation, thinking={"type": "disabled"})
    assert [b.type for b in off.content] == ["text"]


def test_stop_sequences(server):
    c = client(server)
    conversation = [{"role": "user", "content": "Say a long sentence."}]
    full = text(ask(c, conversation, max_tokens=12))
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    m = ask(c, conversation, max_tokens=12, stop_sequences=[stop, "\x00never"])
    assert text(m) == full[: full.index(stop)].strip()
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)


def _turn(**kw) -> Turn:
    fields = {"text": "", "reasoning": None, "prompt_ids": [1, 2], "token_ids": [3],
              "stats": TurnStats(prompt_tokens=10, reused_tokens=4, generated_tokens=3),
              "finish_reason": "stop"}  # fmt: skip
    return Turn(**{**fields, **kw})


async def _collect(stream) -> list[dict]:
    out = []
    async for chunk in stream:
        head, data = chunk.strip().split("\n")
        event = json.loads(data[len("data: ") :])
        assert head == f"event: {event['type']}"
        out.append(event)
    return out


def test_disable_parallel_tool_use_is_parallel_tool_calls_false():
    base = {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": TOOLS}
    for choice, parallel in (({"type": "auto"}, True),
                             ({"type": "auto", "disable_parallel_tool_use": True}, False),
                             ({"type": "any", "disable_parallel_tool_use": False}, True)):  # fmt: skip
        assert api.translate({**base, "tool_choice": choice}).chat.parallel_tool_calls is parallel
    with pytest.raises(ApiError) as e:
        api.translate({**base, "tool_choice": {"type": "auto", "disable_parallel_tool_use": 1}})
    assert e.value.param == "tool_choice.disable_parallel_tool_use"


def test_a_forced_tool_not_among_the_tools_names_tool_choice_name(server):
    body = {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}],
            "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}  # fmt: skip
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 400
    assert "tool_choice.name" in r.json()["error"]["message"]  # not tool_choice.function.name


def test_tool_use_answer_and_stream_shapes():
    """A Turn that calls a tool, as message and as events (the random model never calls one)."""
    import asyncio

    turn = _turn(text="Let me look.", tool_calls=[ToolCall("get_weather", {"city": "Oslo"})])
    request = api.MessagesRequest(parse_request({"messages": [{"role": "user", "content": "x"}]}),
                                  [], None)  # fmt: skip
    m = api.message(turn, request, "msg_1", "tiny", lambda ids: "")
    assert [b["type"] for b in m["content"]] == ["text", "tool_use"]
    assert m["content"][1]["input"] == {"city": "Oslo"} and m["stop_reason"] == "tool_use"
    assert m["usage"]["input_tokens"] == 6 and m["usage"]["cache_read_input_tokens"] == 4

    async def events():
        for e in [("first", 4), ("delta", "", "Let me look.", "Let me look."), ("done", turn)]:
            yield e

    out = asyncio.run(_collect(api.stream(events(), request, "msg_1", "tiny", 10, lambda i: "")))
    assert [e["type"] for e in out] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "message_delta",
        "message_stop",
    ]  # fmt: skip
    assert out[4]["content_block"]["type"] == "tool_use" and out[4]["index"] == 1
    assert json.loads(out[5]["delta"]["partial_json"]) == {"city": "Oslo"}
    assert out[7]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize(
    "body, field",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 4, "messages": []}, "messages"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
         "messages[0].content[0].type"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
          "thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
          "tools": [{"name": "f", "input_schema": "no"}]}, "tools[0].input_schema"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
          "stop_sequences": "X"}, "stop_sequences"),
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
          "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
          "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
          "mcp_servers": [{"type": "url", "url": "http://127.0.0.1:9", "name": "m"}]},
         "mcp_servers"),
    ],
)  # fmt: skip
def test_bad_requests_in_anthropic_shape(server, body, field):
    r = httpx.post(server.url + "/v1/messages", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert field in error["error"]["message"]


def test_render_errors_name_the_message(server):
    # An answer without tool calls followed by a tool result: the renderer's error, about the
    # chat message after the system one, named by its place in the Anthropic request.
    body = {"model": "tiny", "max_tokens": 4, "system": "S", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "r"}]},
    ]}  # fmt: skip
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("messages[1]: only the final answer")


def test_x_api_key_and_bearer(tiny):
    config = ServerConfig(port=0, context_window=WINDOW, warm=False, api_key="s3cret")
    with BackgroundServer(tiny, config) as srv:
        conversation = [{"role": "user", "content": "hi"}]
        assert ask(client(srv, "s3cret"), conversation, max_tokens=1).usage.output_tokens == 1
        with pytest.raises(anthropic.AuthenticationError) as e:
            ask(client(srv, "wrong"), conversation, max_tokens=1)
        assert e.value.body["type"] == "error"
        bearer = {"Authorization": "Bearer s3cret"}
        body = {"model": "tiny", "max_tokens": 1, "messages": conversation}
        assert httpx.post(srv.url + "/v1/messages", json=body, headers=bearer,
                          timeout=30).status_code == 200  # fmt: skip


def test_http_and_internal_errors_in_anthropic_shape(server, monkeypatch):
    """404, 405 and 500 under /v1/messages come in Anthropic's shape (as 400 and 401 do);
    elsewhere in OpenAI's."""

    def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
        assert r.status_code == status, r.text
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == kind
        return body["error"]["message"]

    anthropic_error(httpx.get(server.url + "/v1/messages"), 405, "invalid_request_error")
    anthropic_error(httpx.post(server.url + "/v1/messages/batches", json={}), 404,
                    "not_found_error")  # fmt: skip
    assert httpx.get(server.url + "/v1/chat/completions").json()["error"]["code"] == (
        "method_not_allowed"
    )

    def bug(body, defaults=None):
        raise RuntimeError("a bug")

    monkeypatch.setattr(api, "translate", bug)
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=30)
    assert anthropic_error(r, 500, "api_error") == "internal error: a bug"

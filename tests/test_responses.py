"""/v1/responses (OpenAI's Responses API) on `tiny`, through the official `openai` client.

References: the chat endpoint answering the same conversation (pinned to a fresh full
prefill in test_server.py), `fresh_answer`, and the renderer's boundaries for reuse.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from helpers import SERVER_WINDOW
from helpers import openai_client as client
from test_server import fresh_answer, prompt_of

from engine.serving import responses as api
from engine.serving.completion import ApiError, parse_request
from engine.serving.translation import Origins
from engine.turn import ToolCall, Turn, TurnStats

WINDOW = SERVER_WINDOW
MAX_TOKENS = 5
GREEDY = {"temperature": 0, "extra_body": {"presence_penalty": 0}}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}  # fmt: skip
CHAT_TOOL = {"type": "function", "function": {k: TOOL[k] for k in ("name", "description",
                                                                   "parameters")}}  # fmt: skip


def ask(c: openai.OpenAI, **kw):
    return c.responses.create(model="tiny", max_output_tokens=MAX_TOKENS, **GREEDY, **kw)


def chat(c: openai.OpenAI, messages: list, **kw):
    return c.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                     temperature=0, presence_penalty=0, **kw)  # fmt: skip


def test_plain_and_streamed_equal_the_chat_endpoint(tiny, server):
    c = client(server)
    r = ask(c, input="Tell me about owls.", instructions="You are terse.")
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Tell me about owls."}]  # fmt: skip
    reference = chat(c, messages)
    assert r.object == "response" and r.status == "incomplete"  # it ran out of tokens
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == reference.choices[0].message.content
    assert r.output_text == fresh_answer(tiny, messages, MAX_TOKENS)
    assert r.usage.input_tokens == reference.usage.prompt_tokens
    assert r.usage.output_tokens == MAX_TOKENS
    events = list(ask(c, input="Tell me about owls.", instructions="You are terse.", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == r.output_text == events[-1].response.output_text
    assert events[-1].response.usage.input_tokens_details.cached_tokens == (
        prompt_of(tiny, messages).boundaries.generation_start
    )


def test_previous_response_id_continues_and_reuses(tiny, server):
    c = client(server)
    messages = [{"role": "system", "content": "Remember the thread."}]
    previous_id, previous_prompt = None, None
    for k in range(3):
        question = f"Step {k}: add {k * 5}."
        messages.append({"role": "user", "content": question})
        r = ask(c, input=question, instructions="Remember the thread.",
                previous_response_id=previous_id)  # fmt: skip
        prompt = prompt_of(tiny, messages)
        assert r.usage.input_tokens == len(prompt.ids)
        if previous_prompt is not None:
            cached = r.usage.input_tokens_details.cached_tokens
            assert cached == previous_prompt.boundaries.generation_start
        assert r.output_text == fresh_answer(tiny, messages, MAX_TOKENS)
        messages.append({"role": "assistant", "content": r.output_text})
        previous_id, previous_prompt = r.id, prompt
    # The same conversation sent as items (no previous id) is the same prompt.
    items = [{"role": m["role"], "content": m["content"]} for m in messages[1:]]
    items.append({"role": "user", "content": "One more."})
    full = ask(c, input=items, instructions="Remember the thread.")
    chained = ask(c, input="One more.", instructions="Remember the thread.",
                  previous_response_id=previous_id)  # fmt: skip
    assert full.usage.input_tokens == chained.usage.input_tokens
    assert full.output_text == chained.output_text


def test_function_call_round_trip_renders_as_chat(tiny, server):
    c = client(server)
    items = [
        {"role": "user", "content": "Weather in Rome?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": json.dumps({"city": "Rome"})},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temp_c": 25}'},
    ]  # fmt: skip
    r = ask(c, input=items, tools=[TOOL])
    messages = [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps({"city": "Rome"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 25}'},
    ]  # fmt: skip
    reference = chat(c, messages, tools=[CHAT_TOOL])
    assert r.usage.input_tokens == reference.usage.prompt_tokens
    assert r.output_text == reference.choices[0].message.content
    assert r.output_text == fresh_answer(tiny, messages, MAX_TOKENS, tools=[CHAT_TOOL])


def test_reasoning_items(server):
    c = client(server)
    r = ask(c, input="Think: 3+4?", reasoning={"effort": "high"})
    reference = chat(c, [{"role": "user", "content": "Think: 3+4?"}],
                     extra_body={"chat_template_kwargs": {"enable_thinking": True}})  # fmt: skip
    # Five random tokens never close the think block: all of it is reasoning.
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == reference.choices[0].message.reasoning_content
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == MAX_TOKENS
    events = list(ask(c, input="Think: 3+4?", reasoning={"effort": "high"}, stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == r.output[0].content[0].text
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == MAX_TOKENS
    off = ask(c, input="Think: 3+4?", reasoning={"effort": "none"})
    assert [item.type for item in off.output] == ["message"]
    assert off.usage.output_tokens_details.reasoning_tokens == 0


def test_reasoning_tokens_end_with_the_think_block():
    stats = TurnStats(prompt_tokens=9, generated_tokens=5)
    closed = Turn("4", "3+4", [1], [11, 12, 99, 13, 14], stats, "stop")  # 99: </think>
    assert api.usage(closed, 99)["output_tokens_details"] == {"reasoning_tokens": 3}
    assert api.reasoning_tokens(Turn("", "3+", [1], [11, 12], stats, "length"), 99) == 2
    assert api.reasoning_tokens(Turn("4", None, [1], [11, 12], stats, "stop"), 99) == 0


def test_function_call_output_and_stream_shapes():
    """A Turn that calls a tool (the random model never calls one): items, events, store."""
    turn = Turn("", None, [1], [2], TurnStats(prompt_tokens=9, reused_tokens=3,
                generated_tokens=2), "stop", [ToolCall("get_weather", {"city": "Oslo"})])  # fmt: skip
    chat = parse_request({"messages": [{"role": "user", "content": "x"}]})
    request = api.ResponsesRequest(chat, [{"role": "user", "content": "x"}], True, Origins())
    store = api.ResponseStore(4)

    async def events():
        for e in [("first", 3), ("done", turn)]:
            yield e

    async def collect():
        return [json.loads(c.split("data: ", 1)[1])
                async for c in api.stream(events(), request, store, "resp_1", 0, "tiny")]  # fmt: skip

    out = asyncio.run(collect())
    kinds = [e["type"] for e in out]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]  # fmt: skip
    final = out[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["function_call"]
    call = final["output"][0]
    assert json.loads(call["arguments"]) == {"city": "Oslo"} and call["name"] == "get_weather"
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 3
    # What the store keeps is what the client would resend: the call with its call_id.
    kept = store.get("resp_1")
    assert kept[-1]["tool_calls"][0]["id"] == call["call_id"]
    assert kept[-1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}


def test_store_is_bounded():
    store = api.ResponseStore(2)
    for k in range(3):
        store.put(f"r{k}", [{"role": "user", "content": str(k)}])
    assert store.get("r0") is None and len(store) == 2
    store.get("r1")  # recently used: kept over r2
    store.put("r3", [])
    assert store.get("r1") is not None and store.get("r2") is None


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
         "input[0].content[0].type"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
         "input[0].arguments"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function"}},
         "tool_choice.name"),
        ({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}},
         "tool_choice.name"),
        ({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "allowed_tools",
          "mode": "auto", "tools": [{"type": "function", "name": "get_weather"}]}},
         "tool_choice"),
        ({"input": "hi", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": [{"role": "assistant", "content": "a"}, {"role": "tool"}]}, "input[1].role"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_field(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json={"model": "tiny", **body}, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_tool_choice_in_the_responses_forms(server):
    """The Responses API's own tool_choice forms (what the OpenAI SDK sends), not the chat
    ones: a named function is forced, "none" is plain text."""
    c = client(server)
    r = c.responses.create(model="tiny", input="Weather in Oslo?", tools=[TOOL], temperature=0,
                           tool_choice={"type": "function", "name": "get_weather"},
                           max_output_tokens=40)  # fmt: skip
    assert [item.type for item in r.output] == ["function_call"]
    assert r.output[0].name == "get_weather" and isinstance(json.loads(r.output[0].arguments), dict)
    assert r.tool_choice.type == "function" and r.tool_choice.name == "get_weather"  # as sent
    r = ask(c, input="Weather in Oslo?", tools=[TOOL], tool_choice="none")
    assert [item.type for item in r.output] == ["message"]
    # The name a bad choice is refused under is the Responses one, not the chat's.
    with pytest.raises(openai.BadRequestError) as e:
        ask(c, input="hi", tools=[TOOL], tool_choice={"type": "function", "name": "nope"})
    assert e.value.body["param"] == "tool_choice.name"
    assert "tool_choice.function" not in e.value.body["message"]


def test_render_errors_name_the_input_item(server):
    # A function_call_output with no call before it: the renderer's error, named by item.
    body = {"model": "tiny", "input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call_output", "call_id": "c", "output": "x"},
    ]}  # fmt: skip
    r = httpx.post(server.url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("input[1]")


def test_parallel_tool_calls_is_taken_and_echoed():
    body = {"input": "x", "tools": [TOOL]}
    for given, parallel in ((None, True), (False, False), (True, True)):
        given_body = {**body, "parallel_tool_calls": given} if given is not None else body
        asked = api.translate(given_body, api.ResponseStore())
        assert asked.chat.parallel_tool_calls is parallel
        assert api.response(asked, "resp_1", 0, "tiny")["parallel_tool_calls"] is parallel


@pytest.mark.parametrize("field, value", [("background", True), ("conversation", "conv_1"),
                                          ("prompt", {"id": "pmpt_1"})])  # fmt: skip
def test_server_side_state_it_does_not_keep_is_a_400_naming_it(field, value):
    # Each was ignored: a background request expects to be polled, a conversation or a stored
    # prompt carries context the answer was then written without.
    with pytest.raises(ApiError) as e:
        api.translate({"input": "x", field: value}, api.ResponseStore())
    assert e.value.status == 400 and e.value.param == field
    api.translate({"input": "x", "background": False}, api.ResponseStore())  # what it does

"""Constrained decoding, logprobs and the thinking budget on every face (issue 20).

References are independent of the code under test: a fresh full prefill on empty caches,
`jsonschema`, `mlx` log_softmax of the model's own logits, the official `openai` client.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import mlx.core as mx
import pydantic
import pytest
from helpers import openai_client

import engine
from engine.runtime.generate import decode, prefill
from engine.runtime.grammar import GrammarProcessor
from engine.runtime.sampling import Sampler, SamplingParams

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 5},
                   "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["name", "n"], "additionalProperties": False,
}  # fmt: skip
FORMAT = {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "ping", "parameters": {"type": "object"}}},
]  # fmt: skip


def _fresh(eng, ids, sampler, max_tokens):
    """Tokens decoded after a full prefill of `ids` on empty caches."""
    caches = eng.model.make_caches()
    with eng.lock:
        logits, _ = prefill(eng.model, caches, ids, 0)
        out = list(decode(eng.model, caches, logits, sampler, max_tokens=max_tokens,
                          stop_ids=eng.stop_ids, history=list(ids)))  # fmt: skip
    return [t for t in out if t not in eng.stop_ids]


def test_session_constrained_turn_is_exact_under_the_cache(tiny):
    chat = tiny.session("Answer in JSON.")
    first = chat.send("Who?", max_tokens=40, response_format=FORMAT)
    jsonschema.validate(json.loads(first.text), SCHEMA)
    second = chat.send("And now?", max_tokens=40, response_format=FORMAT)
    assert second.stats.reused_tokens > 0
    jsonschema.validate(json.loads(second.text), SCHEMA)
    sampler = Sampler(SamplingParams(), [GrammarProcessor(tiny, FORMAT)])
    assert _fresh(tiny, second.prompt_ids, sampler, 40) == second.token_ids


def test_logprobs_are_log_softmax_of_the_model_logits(tiny):
    messages = [{"role": "user", "content": "Count."}]
    turn = tiny.chat(messages, max_tokens=5, temperature=1.0, seed=7, logprobs=True,
                     top_logprobs=3, warm=False)  # fmt: skip
    assert len(turn.logprobs) == len(turn.token_ids) > 0
    caches = tiny.model.make_caches()
    ids = list(turn.prompt_ids)
    with tiny.lock:
        logits, _ = prefill(tiny.model, caches, ids, 0)
        for token, lp in zip(turn.token_ids, turn.logprobs):
            ref = logits - mx.logsumexp(logits)
            assert lp.token == token
            assert abs(lp.logprob - ref[token].item()) < 1e-4
            best = mx.argsort(-ref)[:3].tolist()
            assert [t for t, _ in lp.top] == best
            assert all(abs(v - ref[t].item()) < 1e-4 for t, v in lp.top)
            ids.append(token)
            logits, _ = prefill(tiny.model, caches, ids, len(ids) - 1)


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])  # fmt: skip
def test_forced_tool_calls_parse_into_valid_calls(tiny, choice):
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(3):
        turn = tiny.chat([{"role": "user", "content": "Weather?"}], tools=TOOLS,
                         tool_choice=choice, max_tokens=60, temperature=1.0, seed=seed,
                         warm=False)  # fmt: skip
        assert turn.tool_call_error is None and len(turn.tool_calls) == 1, turn
        call = turn.tool_calls[0]
        if isinstance(choice, dict):
            assert call.name == "get_weather"
        jsonschema.validate(call.arguments, by_name[call.name])


@pytest.mark.parametrize("budget", [0, 3])
def test_thinking_budget_closes_the_think_block(tiny, budget):
    think_end = tiny.tokenizer.token_id("</think>")
    turn = tiny.chat([{"role": "user", "content": "Think."}], enable_thinking=True,
                     max_thinking_tokens=budget, max_tokens=budget + 4, temperature=1.0,
                     seed=1, warm=False)  # fmt: skip
    assert think_end in turn.token_ids[: budget + 1], turn.token_ids


@pytest.fixture(scope="module")
def tiny_chat():
    """The trained demo model: in a think block it soon picks <|im_end|> (it never learned
    to close one), which ended constrained answers empty before the reasoning was masked."""
    import engine

    return engine.load("tiny-chat")


@pytest.mark.parametrize("budget", [None, 4])
def test_a_constraint_holds_with_thinking_on(tiny_chat, budget):
    """The reasoning cannot end the answer before the constrained part: an answer that stops
    is the schema's JSON or the forced call (a budget closes the think block in time), one
    that runs out of tokens says "length"."""
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    for seed in (None, 1, 2):
        options = dict(enable_thinking=True, max_thinking_tokens=budget, max_tokens=96,
                       temperature=0.0 if seed is None else 1.0, seed=seed, warm=False)  # fmt: skip
        formatted = tiny_chat.chat(ask, response_format=FORMAT, **options)
        called = tiny_chat.chat(ask, tools=TOOLS, tool_choice="required", **options)
        for turn in (formatted, called):
            assert turn.finish_reason in ("stop", "length"), turn
            assert budget is None or turn.finish_reason == "stop", turn
        if formatted.finish_reason == "stop":
            jsonschema.validate(json.loads(formatted.text), SCHEMA)
        if called.finish_reason == "stop":
            assert called.tool_call_error is None and len(called.tool_calls) == 1, called


def test_a_json_answer_without_a_think_block_begins_with_the_json(tiny_chat):
    """Up to two leading newlines are allowed after `</think>` (the template's "\\n\\n");
    without a think block the JSON begins at once: tiny-chat's raw text was "\\n\\n{}"."""
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    for spec in ({"type": "json_object"}, FORMAT):
        for seed in (None, 1, 2):
            turn = tiny_chat.chat(ask, response_format=spec, enable_thinking=False, max_tokens=48,
                                  temperature=0.0 if seed is None else 1.0, seed=seed, warm=False)  # fmt: skip
            raw = tiny_chat.tokenizer.decode(turn.token_ids)
            assert raw.startswith("{"), (spec, seed, raw)


def test_bad_constraints_raise_naming_them(tiny):
    ok = [{"role": "user", "content": "hi"}]
    cases = [({"response_format": {"type": "yaml"}}, "response_format"),
             ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
                 "type": "string", "pattern": "("}}}}, "response_format"),
             ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
              "tool_choice.function.name"),
             ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
             ({"reasoning_effort": "max"}, "reasoning_effort")]  # fmt: skip
    for options, param in cases:
        with pytest.raises(ValueError) as e:
            tiny.chat_stream(ok, **options)
        assert e.value.param == param, (options, e.value)
    with pytest.raises(ValueError, match="must be 'text', 'json_object', 'json_schema', "
                                         "'regex' or 'lark', got 'yaml'"):  # fmt: skip
        tiny.session().send("hi", response_format={"type": "yaml"})
    for kind in ("regex", "lark"):  # accepted types: the message says what is wrong with it
        with pytest.raises(engine.ChatError, match=f"response_format.{kind} must be a string"):
            tiny.chat(ok, response_format={"type": kind, kind: 5})


# A JSON string argument may hold the markup that ends it in the template's format.
MARKUP_STRINGS = [
    "a</parameter>\n<parameter=x>\nb",
    "x\n</parameter>\n</function>\n</tool_call>\nz",
    '"\\ \u00e9 <tool_call></think>\n',
    "",
]


def _note_tool(text: str) -> list[dict]:
    props = {"text": {"type": "string", "const": text}, "n": {"type": "integer", "const": 3}}
    return [{"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": props, "required": ["text", "n"]}}}]  # fmt: skip


@pytest.mark.parametrize("text", MARKUP_STRINGS)
def test_forced_call_round_trips_a_string_holding_the_markup(tiny, text):
    turn = tiny.chat([{"role": "user", "content": "Note."}], tools=_note_tool(text),
                     tool_choice="required", max_tokens=80, temperature=1.0, seed=1,
                     warm=False)  # fmt: skip
    assert turn.tool_call_error is None, tiny.tokenizer.decode(turn.token_ids)
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [("note", {"text": text, "n": 3})]


def test_tool_results_take_the_options_of_send(tiny):
    chat = tiny.session("Use tools.", tools=TOOLS)
    call = chat.send("Weather?", max_tokens=60, tool_choice="required")
    assert call.tool_calls and chat.pending
    before = (list(chat.tokens), [dict(m) for m in chat.pending])
    for bad in ({"nonsense": 1}, {"response_format": {"type": "yaml"}}):
        with pytest.raises((TypeError, ValueError)):
            chat.send_tool_results(["sunny"], **bad)
        assert (list(chat.tokens), chat.pending) == before  # a bad option loses nothing
    answer = chat.send_tool_results(["sunny"], max_tokens=40, response_format=FORMAT,
                                    logprobs=True, top_logprobs=2)  # fmt: skip
    jsonschema.validate(json.loads(answer.text), SCHEMA)
    assert len(answer.logprobs) == len(answer.token_ids)
    assert [lp.token for lp in answer.logprobs] == answer.token_ids
    assert answer.stats.reused_tokens > len(call.prompt_ids) // 2
    # Exact under the cache: a fresh prefill of the same prompt, the same constraint.
    sampler = Sampler(SamplingParams(), [GrammarProcessor(tiny, FORMAT)])
    assert _fresh(tiny, answer.prompt_ids, sampler, 40) == answer.token_ids
    # A forced call on a tool-results turn too.
    again = tiny.session("Use tools.", tools=TOOLS)
    again.send("Weather?", max_tokens=60, tool_choice="required")
    second = again.send_tool_results(["sunny"], max_tokens=60, tool_choice="required")
    assert second.tool_call_error is None and len(second.tool_calls) == 1


# ----- through the server, with the official client ----------------------------------------


def _ask(c, messages, **kw):
    kw = {"max_tokens": 48, "temperature": 0, "presence_penalty": 0, **kw}
    return c.chat.completions.create(model="tiny", messages=messages, **kw)


SCHEMAS = [
    SCHEMA,
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
     "additionalProperties": False},  # else random weights may write an endless extra key
    {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {
        "type": "string", "pattern": "^[a-z]{1,3}$"}, "maxItems": 2}}, "required": ["tags"],
     "additionalProperties": False},
    {"type": "number", "minimum": -1, "maximum": 1},
    {"enum": [1, "two", None]},
]  # fmt: skip


def test_server_json_schema_and_json_object(server):
    c = openai_client(server)
    for i, schema in enumerate(SCHEMAS):
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
        r = _ask(c, [{"role": "developer", "content": "JSON only."},
                     {"role": "user", "content": f"Item {i}"}], response_format=fmt)  # fmt: skip
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = _ask(c, [{"role": "user", "content": "Any"}], response_format={"type": "json_object"},
             temperature=1.0, seed=2, max_tokens=200)  # fmt: skip
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


class Item(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=5)
    n: int = pydantic.Field(ge=0, le=9)


def test_server_parse_returns_a_pydantic_object(server):
    c = openai_client(server)
    r = c.beta.chat.completions.parse(
        model="tiny", messages=[{"role": "user", "content": "An item"}], response_format=Item,
        max_tokens=48, temperature=0, presence_penalty=0,
    )  # fmt: skip
    assert isinstance(r.choices[0].message.parsed, Item)


def test_server_tool_choice_and_logprobs_stream_equals_non_stream(tiny, server):
    c = openai_client(server)
    r = _ask(c, [{"role": "user", "content": "Ping"}], tools=TOOLS, tool_choice="required")
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    msgs = [{"role": "user", "content": "Count"}]
    whole = _ask(c, msgs, max_tokens=6, logprobs=True, top_logprobs=2)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob - 1e-6
               for e in content)  # greedy: the pick is the most likely  # fmt: skip
    streamed = []
    for chunk in _ask(c, msgs, max_tokens=6, logprobs=True, top_logprobs=2, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content or []
    # The same tokens; the logprobs to float tolerance (the second request reuses the cache).
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(streamed, content))
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace")


def test_server_forced_call_round_trips_a_string_holding_the_markup(server):
    text = MARKUP_STRINGS[1]
    r = _ask(openai_client(server), [{"role": "user", "content": "Note."}],
             tools=_note_tool(text), tool_choice="required", max_tokens=80)  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"text": text, "n": 3}


def test_a_forced_call_of_a_tool_whose_parameters_use_defs_is_valid(tiny):
    """Parameters as pydantic writes them for a nested model: the property is a `$ref` into
    the parameters' `$defs`. Each parameter's grammar is compiled alone, and still resolves
    the reference (it was a GrammarError: "Pointer '/$defs/Unit' does not exist")."""

    class Unit(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str = pydantic.Field(pattern="^[cf]$")

    class Args(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        days: int = pydantic.Field(ge=1, le=7)
        unit: Unit

    params = Args.model_json_schema()
    assert "$defs" in params and "$ref" in params["properties"]["unit"]
    tools = [{"type": "function", "function": {"name": "forecast", "parameters": params}}]
    for seed in range(2):
        turn = tiny.chat([{"role": "user", "content": "Weather?"}], tools=tools,
                         tool_choice="required", max_tokens=60, temperature=1.0, seed=seed,
                         warm=False)  # fmt: skip
        assert turn.tool_call_error is None and len(turn.tool_calls) == 1, turn
        jsonschema.validate(turn.tool_calls[0].arguments, params)


@pytest.mark.parametrize("regex", [r"[^\s\S]", r"a[^\s\S]b"])
def test_a_constraint_no_answer_can_match_is_a_400_naming_it(server, regex):
    # Refused before the turn when it allows no first token; found after "a" otherwise: both
    # were a 500 "generation failed", as if the engine had failed.
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
            "response_format": {"type": "regex", "regex": regex}}  # fmt: skip
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format" and "no answer can match" in error["message"]

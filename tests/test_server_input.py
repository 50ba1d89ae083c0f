"""Hostile and malformed input to `chatml serve`: always a 4xx naming the problem, never a 5xx.

A property-based fuzz test drives the request path the server runs before queueing a job
(`completion.prepare`, `output_budget`, the sampler's construction); targeted tests send the
known classes (lone surrogates, deep nesting, huge integers, bad seeds, tool and content
mismatches) through the real HTTP app.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading

import httpx
import mlx.core as mx
import pytest
from helpers import SERVER_WINDOW, serve_app
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.cli import main
from engine.runtime.sampling import Sampler
from engine.serving.completion import ApiError, Renderer, output_budget, parse_request, prepare
from engine.serving.server import BackgroundServer, ServerConfig, create_app, resolve_api_key
from engine.serving.translation import Origins

WINDOW = SERVER_WINDOW
USER = {"role": "user", "content": "hi"}


def post_raw(srv, raw: bytes | str, timeout: float = 60) -> httpx.Response:
    if isinstance(raw, str):
        raw = raw.encode()
    headers = {"Content-Type": "application/json"}
    return httpx.post(srv.url + "/v1/chat/completions", content=raw, headers=headers,
                      timeout=timeout)  # fmt: skip


def body_with(**fields) -> dict:
    return {"messages": [USER], "max_tokens": 2, "temperature": 0, **fields}


def assert_400(r: httpx.Response, param: str | None = None, words: str = "") -> dict:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error
    assert words.lower() in error["message"].lower(), error
    return error


# ----- the fuzz test ------------------------------------------------------------------------


class Raw(str):
    """JSON text inserted verbatim (what json.dumps cannot or will not produce)."""


def dump(value) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{dump(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dump(v) for v in value) + "]"
    return json.dumps(value)  # ensure_ascii: lone surrogates travel as \ud800 escapes


RAWS = st.sampled_from([
    Raw("9" * 5000), Raw("-" + "1" * 4400), Raw("7" * 1200), Raw("1" * 900), Raw("1e999"),
    Raw("-1e999"), Raw("NaN"), Raw("Infinity"), Raw("[" * 5000 + "]" * 5000),
    Raw('{"a":' * 3000 + "1" + "}" * 3000), Raw("[" * 70 + "]" * 70), Raw(str(2**64)),
    Raw(str(10**30)), Raw("-1"),
])  # fmt: skip
CHARS = st.one_of(st.characters(), st.sampled_from(["\ud800", "\udfff", "\udbff\udc00"]))
TEXTS = st.one_of(
    st.lists(CHARS, max_size=12).map("".join),
    st.sampled_from(["", " ", "<|im_end|>", "<tool_call>", "</think>", "\x00", "get_weather"]),
)
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), TEXTS, RAWS,
    st.integers(min_value=-(2**70), max_value=2**70),
)  # fmt: skip
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXTS, inner, max_size=3),
    max_leaves=8,
)
ARGUMENTS = st.one_of(VALUES.map(dump), TEXTS, VALUES, RAWS.map(lambda r: Raw(json.dumps(r))))
CALLS = st.lists(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["function", "other"]),
         "function": st.fixed_dictionaries({"name": TEXTS, "arguments": ARGUMENTS})},
        optional={"id": st.one_of(TEXTS, VALUES)},
    ),
    max_size=3,
)  # fmt: skip
PARTS = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(TEXTS, VALUES)}),
    st.fixed_dictionaries({"type": st.just("image_url"), "image_url": st.just({"url": "x"})}),
    VALUES,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "robot"])},
    optional={
        "content": st.one_of(TEXTS, st.lists(PARTS, max_size=3), VALUES),
        "tool_calls": st.one_of(CALLS, VALUES),
        "tool_call_id": st.one_of(TEXTS, VALUES),
    },
)
TOOL = st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "retrieval", 1]),
     "function": st.fixed_dictionaries(
         {"name": TEXTS},
         optional={"parameters": st.one_of(VALUES, st.just({"type": "object"})),
                   "description": st.one_of(TEXTS, VALUES)},
     )},
)  # fmt: skip
NUMBERS = st.one_of(VALUES, st.floats(), st.integers(), RAWS)
BODY = st.fixed_dictionaries(
    # Mostly a real user question first, so the fuzz reaches the renderer and the tokenizer.
    {"messages": st.one_of(
        st.lists(MESSAGE, max_size=5).map(lambda ms: [{"role": "user", "content": "q"}, *ms]),
        st.lists(MESSAGE, min_size=1, max_size=4), VALUES,
    )},
    optional={
        **{k: NUMBERS for k in ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens",
                                "presence_penalty", "frequency_penalty", "repetition_penalty",
                                "max_completion_tokens", "n", "top_logprobs")},
        "tools": st.one_of(st.lists(TOOL, max_size=2), VALUES),
        "tool_choice": st.one_of(st.sampled_from(["auto", "none"]), VALUES),
        "chat_template_kwargs": st.one_of(
            st.fixed_dictionaries({}, optional={"enable_thinking": VALUES}), VALUES
        ),
        "stop": st.one_of(TEXTS, st.lists(TEXTS, max_size=5), VALUES),
        "stream": VALUES, "stream_options": VALUES, "logprobs": VALUES, "model": VALUES,
        "response_format": VALUES,
    },
)  # fmt: skip
RAW_BODIES = st.one_of(
    BODY.map(dump),
    VALUES.map(dump),
    st.tuples(BODY.map(dump), st.integers(0, 200)).map(lambda t: t[0][: t[1]]),  # truncated
    RAWS,
).map(lambda text: text.encode("utf-8", "surrogatepass"))
RAW_BODIES = st.one_of(RAW_BODIES, st.binary(max_size=64))


@pytest.fixture(scope="module")
def renderer(tiny):
    return Renderer(tiny, WINDOW)


@settings(max_examples=1000, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
@given(raw=RAW_BODIES)
def test_any_body_is_accepted_or_a_4xx(tiny, renderer, raw):
    try:
        request, prompt = prepare(raw, renderer, tiny.sampling_defaults)
        output_budget(request, len(prompt.ids), WINDOW, 16)
        Sampler(request.params)  # what the model thread builds next: the seed must be usable
    except ApiError as e:
        assert 400 <= e.status < 500 and e.message
        # The error itself can be sent (as Starlette's JSONResponse encodes it).
        json.dumps(e.body(), ensure_ascii=False, allow_nan=False).encode("utf-8")


# ----- item by item, through HTTP -----------------------------------------------------------

LONE = "\ud800"
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def call_turn(call=CALL) -> list:
    return [USER, {"role": "assistant", "content": None, "tool_calls": [call]}]


@pytest.mark.parametrize(
    "body, param",
    [
        (body_with(messages=[{"role": "user", "content": LONE}]), "messages[0].content"),
        (body_with(messages=[{"role": "user", "content": [{"type": "text", "text": "a" + LONE}]}]),
         "messages[0].content[0].text"),
        (body_with(messages=[{"role": "system", "content": LONE}, USER]), "messages[0].content"),
        (body_with(tools=[{"type": "function", "function": {"name": "f" + LONE}}]),
         "tools[0].function.name"),
        (body_with(tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {LONE: {"type": "string"}}}}}]),
         "tools[0].function.parameters.properties"),
        (body_with(messages=[*call_turn({**CALL, "function": {"name": "f", "arguments": {
            "x": LONE}}}), {"role": "tool", "content": "r"}]),
         "messages[1].tool_calls[0].function.arguments.x"),
        (body_with(stop=[LONE]), "stop[0]"),
        (body_with(model=LONE), "model"),
    ],
)  # fmt: skip
def test_lone_surrogates_anywhere_are_a_400(server, body, param):
    assert_400(post_raw(server, json.dumps(body)), param, "surrogate")


def test_lone_surrogate_inside_an_arguments_string(server):
    args = json.dumps({"city": LONE})  # the escape survives into the string: '{"city": "\\ud800"}'
    call = {**CALL, "function": {"name": "f", "arguments": args}}
    body = body_with(messages=[*call_turn(call), {"role": "tool", "content": "r"}])
    assert_400(post_raw(server, json.dumps(body)),
               "messages[1].tool_calls[0].function.arguments", "surrogate")  # fmt: skip


@pytest.mark.parametrize("depth", [65, 1000, 100_000])
def test_deep_nesting_in_the_body_is_a_400(server, depth):
    deep = "[" * depth + "]" * depth
    raw = '{"messages": [{"role": "user", "content": "hi"}], "metadata": ' + deep + "}"
    error = assert_400(post_raw(server, raw))
    assert "nested" in error["message"] or "deep" in error["message"]


@pytest.mark.parametrize("depth", [65, 1000, 100_000])
def test_deep_nesting_in_an_arguments_string_is_a_400(server, depth):
    args = '{"a": ' + "[" * depth + "]" * depth + "}"
    call = {**CALL, "function": {"name": "f", "arguments": args}}
    body = body_with(messages=[*call_turn(call), {"role": "tool", "content": "r"}], tools=TOOLS)
    error = assert_400(post_raw(server, json.dumps(body)),
                       "messages[1].tool_calls[0].function.arguments")  # fmt: skip
    assert "nested" in error["message"]


@pytest.mark.parametrize("digits", [1001, 4301, 50_000])
@pytest.mark.parametrize("where", ["max_tokens", "seed", "top_k", "temperature", "metadata",
                                   "content", "arguments", "tools"])  # fmt: skip
def test_integers_with_thousands_of_digits_are_a_400(server, digits, where):
    big = Raw("9" * digits)
    if where == "content":
        body = body_with(messages=[{"role": "user", "content": [big]}])
    elif where == "arguments":
        call = {**CALL, "function": {"name": "f", "arguments": '{"n": ' + big + "}"}}
        body = body_with(messages=[*call_turn(call), {"role": "tool", "content": "r"}])
    elif where == "tools":
        schema = {"type": "object", "properties": {"n": {"enum": [big]}}}
        body = body_with(
            tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}]
        )
    else:
        body = body_with(**{where: big})
    error = assert_400(post_raw(server, dump(body)))
    assert "digits" in error["message"] or "integer" in error["message"], error


@pytest.mark.parametrize("seed", [-1, 2**64, 10**30, -(2**63), 1.5, "7", True])
def test_seeds_mlx_cannot_take_are_a_400(server, seed):
    assert_400(post_raw(server, json.dumps(body_with(seed=seed))), "seed")


@pytest.mark.parametrize("seed", [0, 2**64 - 1, 2**63])
def test_seeds_across_the_whole_range_work(server, seed):
    r = post_raw(server, json.dumps(body_with(seed=seed, temperature=1.0)))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "value, param",
    [(1e999, "temperature"), (10**400, "temperature"), (-(10**400), "top_p"),
     (10**400, "max_tokens"), (10**400, "presence_penalty"), (10**400, "n")],
    ids=lambda v: v if isinstance(v, str) else f"{str(v)[:6]}..."
)  # fmt: skip
def test_out_of_range_numbers_are_a_400_however_large(server, value, param):
    raw = json.dumps(body_with())[:-1] + f', "{param}": {json.dumps(value)}' + "}"
    assert_400(post_raw(server, raw), param)


# ----- errors renamed for the other APIs ---------------------------------------------------


def test_renamed_errors_keep_their_prose():
    """Only the parameter's name is renamed in a translated error's message: quoted, opening
    the message, or a structured name; the same word in prose stays (it read "the prompt
    take 32769 tokens ... the server never drops prompt" on /v1/completions)."""
    try:
        output_budget(parse_request({"messages": [USER]}), 32769, 32768, 512)
    except ApiError as e:
        long = e
    e = Origins({"messages": "prompt"}).error(long)
    assert e.param == "prompt" and e.code == "context_length_exceeded"
    assert e.message == long.message  # "... but the messages take 32769 tokens ..."
    assert "the messages take 32769 tokens" in e.message and "never drops messages" in e.message
    quoted = ApiError(400, "'messages' must be a non-empty list of messages", param="messages")
    assert Origins({"messages": "input"}).error(quoted).message == (
        "'input' must be a non-empty list of messages"
    )
    origins = Origins({"tool_choice.function": "tool_choice"})
    origins.messages = ["instructions", "input[3]"]
    e = origins.error(ApiError(400, "messages[1].content: must not be empty",
                               param="messages[1].content"))  # fmt: skip
    assert (e.param, e.message) == ("input[3].content", "input[3].content: must not be empty")
    e = origins.error(ApiError(400, "tool_choice.function.name must be a string (see "
                               "tool_choice.function)", param="tool_choice.function.name"))  # fmt: skip
    assert e.message == "tool_choice.name must be a string (see tool_choice.function)"


def test_a_too_long_prompt_on_completions_reads_right(server):
    body = {"model": "tiny", "prompt": list(range(1000, 1001 + WINDOW)), "max_tokens": 1}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    assert f"but the prompt takes {WINDOW + 1} tokens. Shorten the prompt." in error["message"]
    assert "messages" not in error["message"] and "drops prompt" not in error["message"]


# ----- tools and content (issue item 9) -----------------------------------------------------


def result(call_id="call_1", content="r") -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def two_calls() -> dict:
    calls = [CALL, {**CALL, "id": "call_2"}]
    return {"role": "assistant", "content": None, "tool_calls": calls}


@pytest.mark.parametrize(
    "messages, param, words",
    [
        ([*call_turn(), result("call_9")], "messages[2].tool_call_id", "matches no tool call"),
        ([*call_turn(), result(7)], "messages[2].tool_call_id", "matches no tool call"),
        ([*call_turn(), result(), result()], "messages[3].role", "1 tool call"),
        ([*call_turn(), result("call_1"), result("call_2")], "messages[3].role", "1 tool call"),
        ([USER, two_calls(), result("call_1")], "messages[1].tool_calls", "2 tool calls but 1"),
        ([USER, two_calls(), result("call_1"), result("call_1")], "messages[3].tool_call_id",
         "twice"),
        ([USER, two_calls(), result("call_2"), {"role": "assistant", "content": "a"}, USER],
         "messages[1].tool_calls", "2 tool calls but 1"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
         "messages[0].content[0]", "image"),
        ([{"role": "user", "content": [{"type": "text", "text": "see"},
                                       {"type": "image", "image": "x.png"}]}],
         "messages[0].content[1]", "image"),
        ([{"role": "user", "content": [{"type": "video", "video": "x.mp4"}]}],
         "messages[0].content[0]", "video"),
        ([*call_turn(), result(), {"role": "assistant", "content": "ok"},
          {"role": "user", "content": [{"image_url": {"url": "x"}}]}],
         "messages[4].content[0]", "image"),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text",
         "needs its 'text'"),
    ],
)  # fmt: skip
def test_tool_results_and_content_parts_are_checked(server, messages, param, words):
    assert_400(post_raw(server, json.dumps(body_with(messages=messages, tools=TOOLS))),
               param, words)  # fmt: skip


def test_matching_tool_results_are_accepted(server):
    ok = [USER, two_calls(), result("call_2"), result("call_1")]  # any order, each once
    r = post_raw(server, json.dumps(body_with(messages=ok, tools=TOOLS)))
    assert r.status_code == 200, r.text
    no_ids = [USER, {**two_calls(), "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
              {"role": "tool", "content": "r"}]  # fmt: skip
    assert post_raw(server, json.dumps(body_with(messages=no_ids))).status_code == 200


@pytest.mark.parametrize(
    "tools, param",
    [
        ([{"type": "function", "function": {"name": "f", "parameters": "not a schema"}}],
         "tools[0].function.parameters"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}],
         "tools[0].function.parameters"),
        ([{"type": "retrieval"}], "tools[0].type"),
        ([{"type": "code_interpreter", "function": {"name": "f"}}], "tools[0].type"),
        (TOOLS + [{"type": "function", "function": {"name": ""}}], "tools[1].function.name"),
        ([{"type": "function", "function": "f"}], "tools[0].function"),
        ([{"type": "function", "function": {"name": "f", "description": 3}}],
         "tools[0].function.description"),
        (["f"], "tools[0]"),
        ({}, "tools"),
        # Names the model could not write back in Qwen3.5's <function=NAME> markup
        ([{"type": "function", "function": {"name": "f>g"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f\ng"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a>b": {"type": "string"}}}}}],
         "tools[0].function.parameters.properties"),
        ([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"": {"type": "string"}}}}}],
         "tools[0].function.parameters.properties"),
    ],
)  # fmt: skip
def test_bad_tool_definitions_are_a_400(server, tools, param):
    assert_400(post_raw(server, json.dumps(body_with(tools=tools))), param)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"top_logprobs": 0}, "top_logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"chat_template_kwargs": []}, "chat_template_kwargs"),
        ({"chat_template_kwargs": ""}, "chat_template_kwargs"),
        ({"chat_template_kwargs": 0}, "chat_template_kwargs"),
        ({"chat_template_kwargs": False}, "chat_template_kwargs"),
        ({"chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": "high"}, "frequency_penalty"),
    ],
)
def test_fields_that_were_silently_ignored_are_a_400(server, fields, param):
    assert_400(post_raw(server, json.dumps(body_with(**fields))), param)


# ----- one huge request does not stall the others (issue item 7) ---------------------------


def test_text_that_cannot_fit_is_refused_before_tokenizing(tiny, monkeypatch):
    renderer = Renderer(tiny, WINDOW)
    calls = []
    monkeypatch.setattr(
        tiny.tokenizer, "encode", lambda text, spans=None: calls.append(text) or [1]
    )
    big = "word " * (WINDOW * renderer.max_token_bytes // 5 + 10)
    for messages in (
        [{"role": "user", "content": big}],
        [
            {"role": "system", "content": big[: len(big) // 2]},
            {"role": "user", "content": [{"type": "text", "text": big[len(big) // 2 :]}]},
        ],
    ):
        with pytest.raises(ApiError) as e:
            prepare(json.dumps({"messages": messages}).encode(), renderer)
        assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    assert calls == []  # nothing was tokenized
    # Whitespace the template trims does not count; text that fits is tokenized as usual.
    prepare(json.dumps({"messages": [{"role": "user", "content": " " * len(big) + "hi"}]}
                       ).encode(), renderer)  # fmt: skip
    assert calls


def test_a_small_request_is_answered_while_a_large_one_is_tokenized(tiny):
    """The large request's tokenization blocks until the small request has its answer: with
    any lock shared between the two, the small one would wait forever (the test fails at the
    large one's timeout, or the small one's)."""
    config = ServerConfig(port=0, context_window=WINDOW * 4, warm=False)
    small_done, large_in = threading.Event(), threading.Event()
    encode = tiny.tokenizer.encode
    large_text = "large request " * 2000

    def gated(text, spans=None):
        if "large request" in text:
            large_in.set()
            assert small_done.wait(120), "the small request never finished"
        return encode(text, spans)

    with BackgroundServer(tiny, config) as srv:
        srv.app.renderer.engine = _EncodeOverride(tiny, gated)
        out = {}

        def large():
            body = body_with(messages=[{"role": "user", "content": large_text}], max_tokens=1)
            out["large"] = post_raw(srv, json.dumps(body), timeout=240)

        t = threading.Thread(target=large)
        t.start()
        while not large_in.wait(0.5):  # until the large request is being tokenized
            assert t.is_alive()
        small = post_raw(srv, json.dumps(body_with()), timeout=120)
        small_done.set()
        t.join(240)
    assert small.status_code == 200, small.text
    assert out["large"].status_code == 200, out["large"].text


class _EncodeOverride:
    """The engine as the renderer sees it, with a different tokenizer.encode."""

    def __init__(self, engine, encode):
        self._engine, self.tokenizer = engine, _Tokenizer(engine.tokenizer, encode)

    def __getattr__(self, name):
        return getattr(self._engine, name)


class _Tokenizer:
    def __init__(self, tokenizer, encode):
        self._tokenizer, self.encode = tokenizer, encode

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


# ----- the API key (issue item 6) -----------------------------------------------------------


@pytest.mark.parametrize(
    "key, key_file, env, words",
    [
        ("", None, {}, "--api-key is empty"),
        ("   ", None, {}, "--api-key is empty"),
        ("two words", None, {}, "printable ASCII"),
        ("clé", None, {}, "printable ASCII"),
        (None, "", {}, "--api-key-file"),  # no such file
        (None, "EMPTY", {}, "empty"),
        (None, None, {"CHATML_API_KEY": ""}, "CHATML_API_KEY is empty"),
        (None, None, {"CHATML_API_KEY": " \n"}, "CHATML_API_KEY is empty"),
    ],
)
def test_unusable_api_keys_are_refused(tmp_path, key, key_file, env, words):
    if key_file == "EMPTY":
        key_file = tmp_path / "key"
        key_file.write_text("\n")
    with pytest.raises(ValueError, match=words):
        resolve_api_key(key, key_file, env)


def test_api_key_sources_and_whitespace(tmp_path):
    (tmp_path / "key").write_text("  s3cret\n")
    assert resolve_api_key(None, str(tmp_path / "key"), {}) == "s3cret"
    assert resolve_api_key(None, None, {"CHATML_API_KEY": " k "}) == "k"
    assert resolve_api_key(" flag ", None, {"CHATML_API_KEY": "env"}) == "flag"
    assert resolve_api_key(None, None, {}) is None


@pytest.mark.parametrize(
    "argv, env",
    [(["--api-key", ""], {}), (["--api-key", " "], {}), ([], {"CHATML_API_KEY": ""})],
)
def test_serve_refuses_an_empty_key_before_anything_else(monkeypatch, capsys, argv, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr("engine.load", _must_not_load)
    assert main(["serve", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert "empty" in err and "Traceback" not in err


def test_serve_takes_one_key_source(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--api-key", "a", "--api-key-file", "f"])
    assert e.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_the_server_itself_refuses_an_empty_key_and_strips_spaces(tiny):
    for bad in ("", "  "):
        with pytest.raises(ValueError, match="empty"):
            create_app(tiny, ServerConfig(api_key=bad))
    with BackgroundServer(tiny, ServerConfig(port=0, api_key=" s3cret\n")) as srv:
        ok = httpx.get(srv.url + "/v1/models", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert httpx.get(srv.url + "/v1/models").status_code == 401


def _must_not_load(*args, **kwargs):
    raise AssertionError("the model was loaded")


# ----- cross-site requests and DNS rebinding, on loopback without a key ---------------------


def send(srv, path: str = "/v1/chat/completions", **headers) -> httpx.Response:
    body = json.dumps({"messages": [USER], "max_tokens": 1})
    return httpx.post(srv.url + path, content=body, headers=headers, timeout=60)


def test_other_sites_pages_and_names_are_refused_on_loopback(tiny):
    """A web page elsewhere can make the browser POST a "simple" request (text/plain, no
    preflight) to 127.0.0.1, and a page whose name now points at 127.0.0.1 (DNS rebinding)
    can read the answers: both are a 403 in the API's error shape. Clients without an
    Origin (curl, SDKs) and loopback names and origins are served, with any Content-Type."""
    config = ServerConfig(port=0, context_window=WINDOW, warm=False, prepare_grammar=False)
    with BackgroundServer(tiny, config) as srv:
        port = srv.url.rsplit(":", 1)[1]
        r = send(srv, **{"Content-Type": "text/plain", "Origin": "http://attacker.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden_origin"
        assert "--allow-origin http://attacker.example" in r.json()["error"]["message"]
        assert send(srv, Origin="null").status_code == 403
        r = send(srv, Host=f"attacker.example:{port}")
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden_host"
        r = httpx.get(srv.url + "/v1/models", headers={"Host": "attacker.example"}, timeout=60)
        assert r.status_code == 403
        r = send(srv, "/v1/messages", Origin="https://attacker.example")
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        for host in (f"127.0.0.1:{port}", "127.0.0.1", f"localhost:{port}", "localhost",
                     f"[::1]:{port}", "[::1]"):  # fmt: skip
            r = send(srv, Host=host, **{"Content-Type": "text/plain"})
            assert r.status_code == 200, (host, r.text)
        r = send(srv, Origin=f"http://localhost:{port}")
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
        assert send(srv, Origin="http://127.0.0.1:5173").status_code == 200
        assert send(srv).status_code == 200  # no Origin, no Content-Type


def test_allowed_origins_get_cors_and_a_key_lifts_the_checks(tiny, monkeypatch, capsys):
    config = ServerConfig(port=0, context_window=WINDOW, warm=False, prepare_grammar=False,
                          allow_origins=["http://App.example:3000/"])  # fmt: skip
    with BackgroundServer(tiny, config) as srv:
        origin = "http://app.example:3000"
        preflight = httpx.options(srv.url + "/v1/chat/completions", timeout=60, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type, authorization"})  # fmt: skip
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == origin
        r = send(srv, Origin=origin, **{"Content-Type": "application/json"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert send(srv, Origin="http://app.example:4000").status_code == 403
    # With an API key a browser cannot send, neither check applies (a reverse proxy may
    # keep the client's Host): the key is what a request needs.
    config = ServerConfig(port=0, context_window=WINDOW, warm=False, prepare_grammar=False,
                          api_key="s3cret")  # fmt: skip
    with BackgroundServer(tiny, config) as srv:
        key = {"Authorization": "Bearer s3cret"}
        assert send(srv, Host="api.example", Origin="https://api.example", **key).status_code == 200
        assert send(srv, Host="api.example").status_code == 401
    # The flag, through `chatml serve`'s parser: repeatable, checked before the model loads.
    app = serve_app(monkeypatch, tiny, ["--allow-origin", "HTTP://localhost:3000/",
                                        "--allow-origin", "https://x.example:443"])  # fmt: skip
    assert app.config.allow_origins == ["http://localhost:3000", "https://x.example"]
    monkeypatch.setattr("engine.load", _must_not_load)
    assert main(["serve", "--port", "0", "--allow-origin", "localhost:3000"]) == 2
    assert "is not an origin" in capsys.readouterr().err


# ----- `chatml serve` start-up: the banner only once listening ------------------------------


def test_a_taken_port_fails_at_once_naming_it(monkeypatch, capsys):
    monkeypatch.setattr("engine.load", _must_not_load)  # fails before the model loads
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 1
    out, err = capsys.readouterr()
    assert "chatml serve:" not in out  # no banner
    assert f"port {port}" in err and "cannot listen" in err and "Traceback" not in err


def test_the_banner_comes_once_the_server_listens(tiny, tmp_path):
    """`chatml serve --port 0` prints the real address, and it answers right away."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "serve", "--model", "tiny", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    watchdog = threading.Timer(300, proc.kill)  # a hung start fails the test, not the run
    watchdog.start()
    try:
        banner = proc.stdout.readline()
        assert banner.startswith("chatml serve: tiny on http://127.0.0.1:"), banner
        url = banner.split(" on ", 1)[1].strip()
        assert not url.endswith(":0/v1")
        assert httpx.get(url.removesuffix("/v1") + "/health", timeout=60).status_code == 200
        assert "temperature 0.7" in proc.stdout.readline()  # the sampling defaults line
    finally:
        watchdog.cancel()
        proc.terminate()
        proc.wait(60)


# ----- sampling defaults for fields a request omits (issue item 11) -------------------------


def test_omitted_fields_take_the_server_defaults():
    defaults = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "presence_penalty": 1.5}
    p = parse_request({"messages": [USER]}, defaults).params
    assert (p.temperature, p.top_p, p.top_k, p.presence_penalty) == (0.7, 0.8, 20, 1.5)
    assert (p.min_p, p.frequency_penalty, p.repetition_penalty, p.seed) == (0.0, 0.0, 1.0, None)
    given = {"messages": [USER], "temperature": 0, "top_k": 0, "presence_penalty": 0.0}
    p = parse_request(given, defaults).params
    assert (p.temperature, p.top_p, p.top_k, p.presence_penalty) == (0, 0.8, 0, 0.0)
    p = parse_request({"messages": [USER]}).params  # no defaults: OpenAI's
    assert (p.temperature, p.top_p, p.top_k, p.presence_penalty) == (1.0, 1.0, 0, 0.0)


def test_the_server_samples_with_the_checkpoints_defaults(tiny, server):
    """A greedy request that omits the penalties gets the checkpoint's (generation_config.json
    of tiny: presence_penalty 1.5), exactly as the Python API does when told the same."""
    assert tiny.sampling_defaults["presence_penalty"] == 1.5
    assert server.app.sampling == tiny.sampling_defaults
    question = "Say something again and again."
    session = tiny.session(None)
    want = session.send(question, max_tokens=12, temperature=0, presence_penalty=1.5,
                        frequency_penalty=0.0)  # fmt: skip
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": 12,
            "temperature": 0}  # fmt: skip
    r = post_raw(server, json.dumps(body))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want.text
    # An explicit field wins over the default (here a penalty that changes the answer).
    want = tiny.session(None).send(question, max_tokens=12, temperature=0,
                                   presence_penalty=-1.0, frequency_penalty=0.3)  # fmt: skip
    r = post_raw(server, json.dumps({**body, "presence_penalty": -1.0, "frequency_penalty": 0.3}))
    assert r.json()["choices"][0]["message"]["content"] == want.text


# ----- idle warm-up after an answer with several tool calls ---------------------------------


class _Scripted:
    """A sampler that writes `text` then the stop token (a model that calls tools)."""

    reads_history = False

    def __init__(self, engine, text):
        self.ids = engine.tokenizer.encode(text) + [engine.stop_ids[0]]
        self.i = 0

    def __call__(self, logits, recent):
        self.i += 1
        return mx.array(self.ids[min(self.i - 1, len(self.ids) - 1)])


def test_warm_up_after_two_tool_calls_prepares_up_to_their_results(tiny, monkeypatch):
    """The warm-up renders the expected next request, one result per call (which the request
    check now insists on), and prepares everything before the first result."""
    call = "<tool_call>\n<function=f>\n<parameter=x>\n{}\n</parameter>\n</function>\n</tool_call>"
    text = call.format(1) + "\n" + call.format(2)
    monkeypatch.setattr("engine.stateless.make_sampler", lambda *a, **k: _Scripted(tiny, text))
    config = ServerConfig(port=0, context_window=WINDOW, warm=True)
    with BackgroundServer(tiny, config) as srv:
        worker = srv.app.worker
        messages = [{"role": "user", "content": "Call f twice."}]
        r = post_raw(srv, json.dumps(body_with(messages=messages, tools=TOOLS, max_tokens=64)))
        message = r.json()["choices"][0]["message"]
        assert len(message["tool_calls"]) == 2, r.text
        assert worker.idle.wait(60)  # the warm-up is done
        assert worker.warmed_tokens > 0
        monkeypatch.undo()
        results = [result(c["id"], f"result {k}") for k, c in enumerate(message["tool_calls"])]
        follow = [*messages, message, *results]
        prompt = srv.app.renderer.render(parse_request(body_with(messages=follow, tools=TOOLS)))
        r = post_raw(srv, json.dumps(body_with(messages=follow, tools=TOOLS, presence_penalty=0)))
        assert r.status_code == 200, r.text
        first_result = prompt.boundaries.message_starts[-2]
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == first_result


def test_a_context_window_past_the_models_positions_is_refused_when_the_server_is_made(tiny):
    with pytest.raises(ValueError, match="context_window 262145 is past tiny's 262144 positions"):
        create_app(tiny, ServerConfig(port=0, context_window=262_145))

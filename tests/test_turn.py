"""Sampling, streaming, thinking and tool calls as a caller of Session sees them."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from engine.runtime.sampling import Sampler, SamplingParams
from engine.turn import parse_tool_calls, split_reasoning


class Scripted:
    """A sampler that emits fixed text then the stop token (a model with a known answer)."""

    def __init__(self, eng, text: str, stop: bool = True):
        self.ids = eng.tokenizer.encode(text) + ([eng.stop_ids[0]] if stop else [])
        self.i = 0

    def __call__(self, logits, recent):
        self.i += 1
        return mx.array(self.ids[min(self.i, len(self.ids)) - 1])


def scripted(monkeypatch, eng, text, stop=True):
    monkeypatch.setattr("engine.session.Sampler", lambda p: Scripted(eng, text, stop))


# ----- sampling ---------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(tiny):
    def run(**kw):
        return tiny.session("sys").send("Tell me a story.", max_tokens=12, **kw).token_ids

    greedy = run()
    a = run(temperature=1.0, seed=7)
    assert a == run(temperature=1.0, seed=7)
    assert a != run(temperature=1.0, seed=8) or a != greedy
    assert run(temperature=1.0, top_k=1, seed=3) == greedy  # top-1 is greedy
    assert run(temperature=0.7, top_p=1e-6, seed=3) == greedy  # the top token alone
    assert run(temperature=0.7, min_p=0.999, seed=3) == greedy


def test_sampler_filters_keep_only_allowed_tokens():
    logits = mx.array([0.0, 1.0, 2.0, 3.0, 4.0])
    for _ in range(20):
        assert Sampler(SamplingParams(temperature=1.0, top_k=2))(logits, []).item() in (3, 4)
    probs = mx.softmax(logits)
    top_p = float(probs[4] + probs[3]) - 1e-3  # the two best tokens carry this mass
    for seed in range(20):
        t = Sampler(SamplingParams(temperature=1.0, top_p=top_p, seed=seed))(logits, []).item()
        assert t in (3, 4)
    # A repetition penalty pushes a repeated best token below the runner-up.
    penalized = Sampler(SamplingParams(repetition_penalty=2.0))(logits, [4])
    assert penalized.item() == 3


@pytest.mark.parametrize(
    "kw",
    [{"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"min_p": 1.5}, {"repetition_penalty": 0}],
)
def test_bad_sampling_options_are_named(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        SamplingParams(**kw)


# ----- streaming --------------------------------------------------------------------------


def test_stream_pieces_are_whole_characters_and_the_stop_token_never_leaks(tiny, monkeypatch):
    answer = "你好！🎉 天气很好。"
    scripted(monkeypatch, tiny, answer)
    items = list(tiny.session("sys").stream("hi", max_tokens=50))
    pieces, turn = items[:-1], items[-1]
    assert all(isinstance(p, str) and "\ufffd" not in p and p for p in pieces)
    assert "".join(pieces) == answer == turn.text
    assert turn.finish_reason == "stop"
    assert tiny.stop_ids[0] not in turn.token_ids and "<|im_end|>" not in turn.text


def test_length_limit(tiny, monkeypatch):
    scripted(monkeypatch, tiny, "one two three four five six seven", stop=False)
    turn = tiny.session("sys").send("hi", max_tokens=3)
    assert turn.finish_reason == "length" and len(turn.token_ids) == 3


# ----- thinking ---------------------------------------------------------------------------


def test_thinking_turn_separates_reasoning_and_history_drops_it(tiny, monkeypatch):
    s = tiny.session("sys", enable_thinking=True)
    scripted(monkeypatch, tiny, "The user greets me.\n</think>\n\nHello there!")
    turn = s.send("hi", max_tokens=50)
    assert s.render([{"role": "user", "content": "x"}], 5).text.endswith("<think>\n")
    assert (turn.reasoning, turn.text) == ("The user greets me.", "Hello there!")
    assert s.history[-1][-1] == {
        "role": "assistant", "content": "Hello there!", "reasoning_content": "The user greets me.",
    }  # fmt: skip
    nxt = s.render([{"role": "user", "content": "next"}], 5).text
    assert "Hello there!" in nxt and "The user greets me." not in nxt  # the template drops it


def test_split_reasoning_edge_cases():
    assert split_reasoning("no tags", thinking=False) == (None, "no tags")
    assert split_reasoning("still thinking", thinking=True) == ("still thinking", "")
    assert split_reasoning("a</think>b</think>c", thinking=True) == ("a", "b</think>c")


# ----- tool calls -------------------------------------------------------------------------

CALL = (
    "<tool_call>\n<function=search>\n<parameter=query>\nqwen 3.5\n</parameter>\n"
    '<parameter=filters>\n{"year": [2025, 2026], "lang": "zh"}\n</parameter>\n</function>\n</tool_call>'
)


def test_parse_tool_calls_nested_arguments():
    content, calls, err = parse_tool_calls("Searching.\n\n" + CALL + "\n" + CALL)
    assert err is None and content == "Searching."
    assert [c.name for c in calls] == ["search", "search"]
    assert calls[0].arguments == {
        "query": "qwen 3.5",
        "filters": {"year": [2025, 2026], "lang": "zh"},
    }


def test_json_arguments_may_hold_the_closing_markup():
    # What a forced call writes: each value compact JSON, strings quoted.
    args = {"text": "x\n</parameter>\n</function>\n</tool_call>\n<tool_call>",
            "obj": {"k": ["</parameter>", 1.5, None]}, "n": 3, "q": 'say "</function>"'}  # fmt: skip
    body = "".join(f"<parameter={k}>\n{json.dumps(v)}\n</parameter>\n" for k, v in args.items())
    call = f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>"
    content, calls, err = parse_tool_calls("Sure.\n" + call + "\n" + call)
    assert (content, err) == ("Sure.", None)
    assert [(c.name, c.arguments) for c in calls] == [("f", args), ("f", args)]
    # A plain (unquoted) string still ends at the first </parameter>, as the template writes.
    plain = ("<tool_call>\n<function=f>\n<parameter=a>\n[1, 2] and more\n</parameter>\n"
             "</function>\n</tool_call>")  # fmt: skip
    assert parse_tool_calls(plain)[1][0].arguments == {"a": "[1, 2] and more"}


def _call(value: str) -> str:
    return f"<tool_call>\n<function=f>\n<parameter=a>\n{value}\n</parameter>\n</function>\n</tool_call>"


def test_generated_arguments_are_valid_unicode_and_any_depth_parses():
    """A model may write escapes JSON decodes but UTF-8 cannot encode (a lone `\\ud800`):
    they become U+FFFD (pairs stay one character), so logging or sending the call cannot fail;
    a value nested past what Python's JSON decoder takes is the plain string, not a crash."""
    (call,) = parse_tool_calls(_call('{"k\\udc00": ["\\ud800b", "\\ud83d\\ude00", 7]}'))[1]
    assert call.arguments == {"a": {"k\ufffd": ["\ufffdb", "\U0001f600", 7]}}
    json.dumps(call.arguments, ensure_ascii=False).encode()  # what a session log does
    deep = "[" * 5000 + "]" * 5000
    (call,) = parse_tool_calls(_call(deep))[1]
    assert call.arguments == {"a": deep}
    (call,) = parse_tool_calls(_call("[" * 800 + '"\\ud800"' + "]" * 800))[1]
    value = call.arguments["a"]
    for _ in range(800):
        (value,) = value
    assert value == "\ufffd"


@pytest.mark.parametrize(
    "bad",
    ["<tool_call>\n<function=f>\n", "<tool_call>oops</tool_call>",
     "<tool_call>\n<function=f>\nstray\n</function>\n</tool_call>", CALL + " trailing text"],
)  # fmt: skip
def test_malformed_tool_calls_are_reported_not_guessed(bad):
    content, calls, err = parse_tool_calls(bad)
    assert calls == [] and err and content == bad


def test_tool_round_trip_continues_the_turn(tiny, monkeypatch):
    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    s = tiny.session("sys", tools=tools)
    scripted(monkeypatch, tiny, CALL)
    call = s.send("find qwen", max_tokens=100)
    assert [c.name for c in call.tool_calls] == ["search"] and s.history == [] and s.pending
    scripted(monkeypatch, tiny, "Found it.")
    answer = s.send_tool_results(['{"hits": 3}'])
    assert answer.text == "Found it." and not s.pending
    roles = [m["role"] for m in s.history[0]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert '<tool_response>\n{"hits": 3}\n</tool_response>' in tiny.tokenizer.decode(
        answer.prompt_ids
    )
    assert answer.stats.reused_tokens >= len(call.prompt_ids) - 8  # reuse across the tool turn
    with pytest.raises(ValueError, match="results"):
        s.send_tool_results([])


def test_malformed_call_in_a_turn_is_reported(tiny, monkeypatch):
    scripted(monkeypatch, tiny, "<tool_call>\n<function=f>\nnot closed")
    turn = tiny.session("sys").send("x", max_tokens=100)
    assert turn.tool_calls == [] and "tool_call" in turn.tool_call_error
    assert turn.text == "<tool_call>\n<function=f>\nnot closed"

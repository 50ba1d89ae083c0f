"""The session cache against independent references: a fresh full prefill and mlx-lm.

Randomized conversation scripts exercise every turn shape (plain, thinking, window trimming,
a small token budget, tool turns, regenerate, edit-last, failures, interrupts, eviction); at
every turn the greedy tokens must equal a fresh full prefill of the same prompt ids and
mlx-lm's generation, and the logits that start the answer must agree within 1e-4.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from helpers import QUESTIONS, fresh_greedy, mlx_lm_load

import engine
from engine.runtime.sampling import Sampler, SamplingParams

MAX_TOKENS = 5


@pytest.fixture(scope="module")
def mlx_lm_model(tiny):
    return mlx_lm_load(tiny.path)


def mlx_lm_greedy(model_and_tok, ids, max_tokens=MAX_TOKENS):
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tok = model_and_tok
    out = []
    for r in stream_generate(model, tok, prompt=ids, max_tokens=max_tokens,
                             sampler=make_sampler(temp=0.0)):  # fmt: skip
        if r.finish_reason != "stop":
            out.append(r.token)
    return out


def check_turn(eng, turn, logits, mlx_lm_model=None, max_tokens=MAX_TOKENS):
    expected, ref_logits = fresh_greedy(eng, turn.prompt_ids, max_tokens)
    assert turn.token_ids == expected
    assert mx.abs(logits - ref_logits).max().item() < 1e-4
    if mlx_lm_model is not None:
        assert mlx_lm_greedy(mlx_lm_model, turn.prompt_ids, max_tokens) == expected


# ----- minimality -----------------------------------------------------------------------


def test_plain_turns_prefill_only_the_reanswered_tail_and_the_new_message(tiny):
    s = tiny.session("You are a helpful assistant.")
    first = s.send(QUESTIONS[0], max_tokens=MAX_TOKENS)
    assert first.stats.reused_tokens == 0 and first.stats.prefilled_tokens == len(first.prompt_ids)
    for q in QUESTIONS[1:5]:
        prompt = s.render([{"role": "user", "content": q}], MAX_TOKENS)
        turn = s.send(q, max_tokens=MAX_TOKENS)
        assert prompt.ids == turn.prompt_ids
        # The template re-renders the previous answer without its think block: the cache is
        # good up to right after that answer's "<|im_start|>assistant\n", and no further.
        divergence = prompt.boundaries.assistant_starts[-1]
        assert turn.stats.reused_tokens == divergence
        assert turn.stats.prefilled_tokens == len(turn.prompt_ids) - divergence
        assert turn.stats.prompt_tokens == len(turn.prompt_ids)


def test_trimming_turn_restarts_from_the_system_snapshot(tiny):
    s = tiny.session("You are a helpful assistant.", max_exchanges=2)
    for q in QUESTIONS[:3]:
        s.send(q, max_tokens=MAX_TOKENS)
    system_end = s.render([{"role": "user", "content": "x"}], MAX_TOKENS).boundaries.system_end
    turn = s.send(QUESTIONS[3], max_tokens=MAX_TOKENS)  # 3 in history: the window drops one
    assert turn.stats.dropped_exchanges == 1
    assert turn.stats.reused_tokens == system_end > 0
    assert turn.stats.prefilled_tokens == len(turn.prompt_ids) - system_end


def test_snapshots_are_kept_only_where_a_later_turn_resumes(tiny):
    s = tiny.session("You are a helpful assistant.", max_exchanges=2)
    for q in QUESTIONS[:5]:  # turns 3-5 trim the window
        b = s.render([{"role": "user", "content": q}], MAX_TOKENS).boundaries
        turn = s.send(q, max_tokens=MAX_TOKENS)
        # the system block's end (trimming turns), the new message's start (edit), right after
        # "<|im_start|>assistant\n" (the next turn, regenerate) and the prompt's end
        expected = {b.system_end, b.message_starts[-1], b.generation_start, len(turn.prompt_ids)}
        assert set(s.seq.snapshots) == expected
    assert s.regenerate(max_tokens=MAX_TOKENS).stats.prefilled_tokens <= 6  # still all it needs


def test_identical_resend_prefills_a_handful(tiny):
    s = tiny.session("sys")
    s.send(QUESTIONS[0], max_tokens=MAX_TOKENS)
    s.send(QUESTIONS[1], max_tokens=MAX_TOKENS)
    again = s.regenerate(max_tokens=MAX_TOKENS)
    assert again.stats.prefilled_tokens <= 6
    assert len(s.history) == 2


def test_without_system_prompt_a_trimming_turn_prefills_everything(tiny):
    s = tiny.session(None, max_exchanges=1)
    s.send(QUESTIONS[0], max_tokens=MAX_TOKENS)
    s.send(QUESTIONS[1], max_tokens=MAX_TOKENS)
    turn = s.send(QUESTIONS[2], max_tokens=MAX_TOKENS)
    assert turn.stats.dropped_exchanges == 1
    assert turn.stats.reused_tokens == 0


# ----- failures leave no trace ------------------------------------------------------------


class Boom(RuntimeError):
    pass


def _fail_after(monkeypatch, eng, calls):
    """Make the model raise on its `calls`-th forward pass (prefill chunks and decode steps)."""
    count = {"n": 0}
    real_call, real_hidden = type(eng.model).__call__, type(eng.model).hidden

    def hidden(self, ids, caches):
        count["n"] += 1
        if count["n"] == calls:
            raise Boom("injected")
        return real_hidden(self, ids, caches)

    def call(self, ids, caches, *, last_only=False):
        h = hidden(self, ids, caches)
        return self.logits(h[:, -1:] if last_only else h)

    monkeypatch.setattr(type(eng.model), "hidden", hidden)
    monkeypatch.setattr(type(eng.model), "__call__", call)
    return lambda: (monkeypatch.setattr(type(eng.model), "hidden", real_hidden),
                    monkeypatch.setattr(type(eng.model), "__call__", real_call))  # fmt: skip


@pytest.mark.parametrize("fail_at", [1, 2, 4])  # first prefill chunk, the second, decode
def test_exception_mid_turn_rolls_back(tiny, monkeypatch, first_logits, fail_at):
    s = tiny.session("You are a helpful assistant.")
    s.send(QUESTIONS[0], max_tokens=MAX_TOKENS)
    s.send(QUESTIONS[1], max_tokens=MAX_TOKENS)
    history, tokens = [list(e) for e in s.history], list(s.tokens)
    undo = _fail_after(monkeypatch, tiny, fail_at)
    with pytest.raises(Boom):
        s.send(QUESTIONS[4] * 20, max_tokens=MAX_TOKENS)  # long: two prefill chunks
    undo()
    assert s.history == history
    assert tokens[: len(s.tokens)] == s.tokens  # the cache holds a prefix of what it had
    turn = s.send(QUESTIONS[2], max_tokens=MAX_TOKENS)
    check_turn(tiny, turn, first_logits[-1])


def test_interrupted_stream_and_keyboard_interrupt_roll_back(tiny, first_logits):
    s = tiny.session("sys")
    s.send(QUESTIONS[0], max_tokens=MAX_TOKENS)
    history = [list(e) for e in s.history]
    stream = s.stream(QUESTIONS[1], max_tokens=20)
    next(stream)
    stream.close()  # the caller walked away mid-answer
    assert s.history == history

    def interrupt(turn):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        s.send(QUESTIONS[1], max_tokens=MAX_TOKENS, validate=interrupt)
    assert s.history == history
    turn = s.send(QUESTIONS[1], max_tokens=MAX_TOKENS)
    check_turn(tiny, turn, first_logits[-1])


def _interrupt_after_the_job(monkeypatch, where):
    """Ctrl+C (a KeyboardInterrupt in the caller) once the model thread has finished the turn:
    "returned", as the caller's wait for the job's return ends; "recorded", right after the
    caller's side has recorded the exchange, before the turn is handed over."""
    from engine.runtime.worker import ModelThread
    from engine.session import Session

    if where == "returned":
        real_iterate = ModelThread.iterate

        def iterate(self, make):
            yield from real_iterate(self, make)  # the job ran to its end and returned
            raise KeyboardInterrupt

        monkeypatch.setattr(ModelThread, "iterate", iterate)
    else:
        real_record = Session._record

        def record(self, *args):
            real_record(self, *args)
            raise KeyboardInterrupt

        monkeypatch.setattr(Session, "_record", record)


@pytest.mark.parametrize("where", ["returned", "recorded"])
def test_ctrl_c_after_the_model_thread_finished_the_turn_leaves_no_trace(tiny, monkeypatch,
                                                                         where):  # fmt: skip
    s = tiny.session("sys")
    s.send(QUESTIONS[0], max_tokens=MAX_TOKENS)
    q1_start = s.render([{"role": "user", "content": QUESTIONS[1]}], MAX_TOKENS).boundaries
    s.send(QUESTIONS[1], max_tokens=MAX_TOKENS)
    history, tokens, snaps = [list(e) for e in s.history], list(s.tokens), set(s.seq.snapshots)
    for attempt in (lambda: s.send(QUESTIONS[2], max_tokens=MAX_TOKENS),
                    lambda: s.regenerate(max_tokens=MAX_TOKENS),
                    lambda: s.edit_last(QUESTIONS[3], max_tokens=MAX_TOKENS)):  # fmt: skip
        _interrupt_after_the_job(monkeypatch, where)
        with pytest.raises(KeyboardInterrupt):
            attempt()
        monkeypatch.undo()
        assert s.history == history and s.pending == []  # the last question once, not twice
        assert tokens[: len(s.tokens)] == s.tokens  # the caches: as before, or a snapshot of it
        assert set(s.seq.snapshots) <= snaps and not s._answering.locked()
    # The conversation goes on as if the interrupted turns never happened: against a fresh
    # engine given the same messages.
    again = s.regenerate(max_tokens=MAX_TOKENS)
    nxt = s.send(QUESTIONS[2], max_tokens=MAX_TOKENS)
    assert [e[0]["content"] for e in s.history] == QUESTIONS[:3]
    fresh = engine.load("tiny")
    messages = [{"role": "system", "content": "sys"}, *s.history[0]]
    for ex, turn in zip(s.history[1:], (again, nxt)):
        messages.append(ex[0])
        ref = fresh.chat(messages, max_tokens=MAX_TOKENS, warm=False)
        assert (turn.prompt_ids, turn.token_ids) == (ref.prompt_ids, ref.token_ids)
        messages.append(ex[1])
    assert again.stats.reused_tokens >= q1_start.message_starts[-1]  # the kept snapshots serve


def test_rejected_answer_is_not_recorded(tiny):
    s = tiny.session("sys")
    s.send(QUESTIONS[0], max_tokens=MAX_TOKENS)

    def must_be_json(turn):
        import json

        json.loads(turn.text)

    with pytest.raises(ValueError):
        s.send(QUESTIONS[1], max_tokens=MAX_TOKENS, validate=must_be_json)
    assert len(s.history) == 1


def test_bad_input_raises_before_touching_anything(tiny):
    s = tiny.session("sys")
    s.send(QUESTIONS[0], max_tokens=MAX_TOKENS)
    tokens, snaps = list(s.tokens), dict(s.seq.snapshots)
    for bad in ["", "   "]:
        with pytest.raises(ValueError, match="empty"):
            s.send(bad)
    with pytest.raises(ValueError, match="content"):
        s.send(42)
    with pytest.raises(ValueError, match="max_tokens"):
        s.send("hi", max_tokens=0)
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be >= 0 and finite"):
            s.send("hi", temperature=bad)
    with pytest.raises(ValueError, match="repetition_penalty"):
        s.send("hi", repetition_penalty=float("nan"))
    with pytest.raises(ValueError, match="no tool calls"):
        s.send_tool_results(["x"])
    small = tiny.session("sys", context_window=40)
    with pytest.raises(ValueError, match="context window 40 minus 8 tokens reserved"):
        small.send("word " * 200, max_tokens=8)
    with pytest.raises(TypeError, match="max_tokens must be an integer, got 2.5"):
        s.send("hi", max_tokens=2.5)
    assert s.tokens == tokens and s.seq.snapshots == snaps and len(s.history) == 1


@pytest.mark.parametrize("part", [{"type": "image", "image": "cat.png"},
                                  {"type": "image_url", "image_url": {"url": "data:,"}},
                                  {"type": "video", "video": "clip.mp4"}])  # fmt: skip
def test_image_and_video_parts_are_refused_as_engine_chat_refuses_them(tiny, part):
    """The engine runs the text model only: a session must not feed the template's vision
    placeholders to it with nothing behind them (Engine.chat and the server refuse them)."""
    s = tiny.session("sys")
    s.send(QUESTIONS[0], max_tokens=MAX_TOKENS)
    tokens, snaps, history = list(s.tokens), dict(s.seq.snapshots), list(s.history)
    content = [part, {"type": "text", "text": "What is this?"}]
    with pytest.raises(ValueError, match="input is not supported"):
        tiny.chat([{"role": "user", "content": content}], max_tokens=MAX_TOKENS)
    for attempt in (s.send, s.edit_last):
        with pytest.raises(ValueError, match="input is not supported: this engine runs the text"):
            attempt(content, max_tokens=MAX_TOKENS)
    assert s.tokens == tokens and s.seq.snapshots == snaps and s.history == history


def test_a_turn_during_an_open_stream_is_refused_and_changes_nothing(tiny):
    s = tiny.session("sys")
    s.send(QUESTIONS[0], max_tokens=MAX_TOKENS)
    never_started = s.stream(QUESTIONS[4])  # made before: holds nothing until iterated
    stream = s.stream(QUESTIONS[1], max_tokens=MAX_TOKENS, ignore_eos=True)
    first = next(stream)
    tokens = list(s.tokens)
    for start_another in (lambda: s.send(QUESTIONS[2]), lambda: s.stream(QUESTIONS[3]),
                          s.regenerate, never_started.__next__, s.reset, s.warm,
                          s.warm_in_background, lambda: s.edit_last("x"),
                          lambda: s.send_tool_results(["x"])):  # fmt: skip
        with pytest.raises(engine.TurnConflict, match="still answering"):
            start_another()
    assert s.tokens == tokens and len(s.history) == 1
    *pieces, turn = [first, *stream]  # the open turn goes on, exact
    assert turn.text == "".join(pieces)
    assert turn.token_ids == fresh_greedy(tiny, turn.prompt_ids, MAX_TOKENS)[0]
    stale = s.stream(QUESTIONS[3])
    nxt = s.send(QUESTIONS[2], max_tokens=MAX_TOKENS)  # and the session is free again
    assert len(s.history) == 3 and nxt.stats.reused_tokens > 0
    with pytest.raises(engine.TurnConflict, match="made before the session's last turn"):
        next(stale)  # its prompt lacks the exchange just answered
    assert len(s.history) == 3


def test_a_turn_while_another_thread_runs_one_is_refused_saying_so(tiny):
    import threading

    s = tiny.session("sys")
    inside, release, done = threading.Event(), threading.Event(), []

    def hold(turn):  # the other thread's turn stays open until released
        inside.set()
        assert release.wait(60)

    other = threading.Thread(target=lambda: done.append(
        s.send(QUESTIONS[0], max_tokens=MAX_TOKENS, validate=hold)))  # fmt: skip
    other.start()
    try:
        assert inside.wait(60)
        with pytest.raises(engine.TurnConflict, match="a turn started on another thread"):
            s.send(QUESTIONS[1], max_tokens=MAX_TOKENS)
    finally:
        release.set()
        other.join(60)
    assert done and len(s.history) == 1
    stream = s.stream(QUESTIONS[1], max_tokens=MAX_TOKENS)
    next(stream)
    with pytest.raises(engine.TurnConflict, match="a stream of it is open on this thread"):
        s.send(QUESTIONS[2], max_tokens=MAX_TOKENS)
    stream.close()


def test_reset_during_an_open_stream_is_refused_and_the_session_stays_exact(tiny):
    s = tiny.session("sys")
    st = s.stream("Hello", max_tokens=MAX_TOKENS)
    next(st)
    with pytest.raises(engine.TurnConflict, match="still answering"):
        s.reset()
    *_, first = st
    assert len(s.history) == 1 and first.token_ids == fresh_greedy(tiny, first.prompt_ids)[0]
    nxt = s.send("next", max_tokens=MAX_TOKENS)  # used to fail: no recurrent state recorded
    assert nxt.token_ids == fresh_greedy(tiny, nxt.prompt_ids, MAX_TOKENS)[0]
    assert nxt.stats.reused_tokens > 0 and len(s.history) == 2


def test_reset_makes_a_stream_made_before_it_stale(tiny):
    s = tiny.session("sys")
    s.send(QUESTIONS[0], max_tokens=MAX_TOKENS)
    old = s.stream(QUESTIONS[1], max_tokens=MAX_TOKENS)  # its prompt holds the first exchange
    s.reset()
    with pytest.raises(engine.TurnConflict, match="made before the session's last turn"):
        next(old)
    assert s.history == [] and s.tokens == []
    turn = s.send(QUESTIONS[1], max_tokens=MAX_TOKENS)
    assert QUESTIONS[0] not in tiny.tokenizer.decode(turn.prompt_ids)
    assert turn.token_ids == fresh_greedy(tiny, turn.prompt_ids, MAX_TOKENS)[0]


def _pending_tool_call(eng, s, monkeypatch):
    thinks = s.render([{"role": "user", "content": "q"}], 1).text.endswith("<think>\n")
    text = ("I should look it up.\n</think>\n\n" if thinks else "") + TOOL_CALL
    monkeypatch.setattr("engine.session.Sampler", lambda p: ScriptedSampler(eng, text))
    call = s.send(QUESTIONS[1], max_tokens=200, tools=TOOLS)
    monkeypatch.setattr("engine.session.Sampler", Sampler)
    assert call.tool_calls and s.pending


@pytest.mark.parametrize("history", [0, 1])
def test_regenerate_and_edit_with_tool_calls_pending_redo_the_pending_question(tiny, monkeypatch,
                                                                               history):  # fmt: skip
    s = tiny.session("sys")
    if history:
        s.send(QUESTIONS[0], max_tokens=MAX_TOKENS)
    _pending_tool_call(tiny, s, monkeypatch)  # asks QUESTIONS[1], which calls a tool
    before, pending = [list(e) for e in s.history], list(s.pending)

    def interrupt(turn):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # a failed redo keeps the pending exchange
        s.regenerate(max_tokens=MAX_TOKENS, validate=interrupt)
    assert s.history == before and s.pending == pending
    again = s.regenerate(max_tokens=MAX_TOKENS)
    assert [e[0]["content"] for e in s.history] == [*QUESTIONS[:history], QUESTIONS[1]]
    edited = s.edit_last(QUESTIONS[2], max_tokens=MAX_TOKENS)
    assert [e[0]["content"] for e in s.history] == [*QUESTIONS[:history], QUESTIONS[2]]
    # Against a fresh engine given the same messages (the session's tools are the call's).
    fresh = engine.load("tiny")
    messages = [{"role": "system", "content": "sys"}, *[m for e in before for m in e]]
    for q, turn in ((QUESTIONS[1], again), (QUESTIONS[2], edited)):
        ref = fresh.chat([*messages, {"role": "user", "content": q}], tools=TOOLS,
                         max_tokens=MAX_TOKENS, warm=False)  # fmt: skip
        assert (turn.prompt_ids, turn.token_ids) == (ref.prompt_ids, ref.token_ids)


@pytest.mark.parametrize(
    "make_bad",
    [
        lambda s: s.send("\ud800"),
        lambda s: s.send("caf\udce9 au lait"),  # what surrogateescape makes of Latin-1 bytes
        lambda s: s.stream("ok", tools=[{**TOOLS[0], "function": {"name": "f\udcff"}}]),
        lambda s: s.send(
            "ok",
            tools=[
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"properties": {"\udc80": {}}}},
                }
            ],
        ),  # fmt: skip
        lambda s: s.edit_last("\udfff"),
        lambda s: s.send_tool_results(["\ud800"]),
        lambda s: s.send_tool_results([{"content": "21", "name": "w\udc00"}]),
    ],
    ids=[
        "text",
        "escaped-bytes",
        "tool-name",
        "tool-key",
        "edit",
        "tool-result",
        "tool-result-field",
    ],  # fmt: skip
)
def test_lone_surrogates_anywhere_are_a_value_error_that_changes_nothing(tiny, monkeypatch,
                                                                         make_bad):  # fmt: skip
    s = tiny.session("sys")
    s.send(QUESTIONS[0], max_tokens=MAX_TOKENS)
    _pending_tool_call(tiny, s, monkeypatch)
    history, pending = [list(e) for e in s.history], list(s.pending)
    tokens, snaps = list(s.tokens), dict(s.seq.snapshots)
    try:
        make_bad(s)
    except ValueError as e:
        assert "lone surrogate" in str(e)
    else:
        pytest.fail("no ValueError")
    assert s.history == history and s.pending == pending
    assert s.tokens == tokens and s.seq.snapshots == snaps


@pytest.mark.parametrize("where", ["system", "tools"])
def test_lone_surrogates_in_session_options_raise_when_the_session_is_made(tiny, where):
    options = {"system": "caf\udce9"} if where == "system" else {
        "tools": [{"type": "function", "function": {"name": "\ud83d"}}]}  # fmt: skip
    with pytest.raises(ValueError, match=f"{where}.*lone surrogate"):
        tiny.session(**options)


def _deep_tool(depth: int = 1000) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return {"type": "function", "function": {"name": "f", "parameters": schema}}


def test_deep_nesting_is_a_value_error_not_a_recursion_error(tiny, monkeypatch):
    with pytest.raises(ValueError, match=r"tools\[0\]\['function'\]\['parameters'\].*nested "
                                         "deeper than 64 levels"):  # fmt: skip
        tiny.session("sys", tools=[_deep_tool()])
    s = tiny.session("sys")
    s.send(QUESTIONS[0], max_tokens=MAX_TOKENS)
    _pending_tool_call(tiny, s, monkeypatch)
    history, pending, tokens = [list(e) for e in s.history], list(s.pending), list(s.tokens)
    for bad in (lambda: s.send("hi", tools=[_deep_tool()]),
                lambda: s.send_tool_results([{"content": "x", "extra": _nested_list(1000)}])):  # fmt: skip
        with pytest.raises(ValueError, match="nested deeper than 64 levels"):
            bad()
        assert s.history == history and s.pending == pending and s.tokens == tokens


def _nested_list(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("tool_choice", [None, "required"])
def test_bad_tool_definitions_at_a_turn_are_refused_as_engine_chat_refuses_them(tiny, monkeypatch,
                                                                                tool_choice):  # fmt: skip
    bad = [{"type": "function", "function": {}}]
    with pytest.raises(engine.ChatError, match="the function name must be a non-empty string"):
        tiny.chat([{"role": "user", "content": "x"}], tools=bad, tool_choice=tool_choice)
    s = tiny.session("sys", tools=TOOLS)
    s.send(QUESTIONS[0], max_tokens=MAX_TOKENS)
    _pending_tool_call(tiny, s, monkeypatch)
    history, pending, tokens = [list(e) for e in s.history], list(s.pending), list(s.tokens)
    for turn in (lambda: s.send("x", tools=bad, tool_choice=tool_choice),
                 lambda: s.send_tool_results(["21"], tools=bad, tool_choice=tool_choice)):  # fmt: skip
        with pytest.raises(ValueError, match=r"tools\[0\].function.name'?: the function name"):
            turn()
        assert s.tools == TOOLS and s.history == history and s.pending == pending
        assert s.tokens == tokens


@pytest.mark.parametrize(
    "results, message",
    [
        (["21", "22"], "2 tool results for 1 tool call"),
        ([{"content": "21"}, "22", "23"], "3 tool results for 1 tool call"),
        ([{"content": "21", "role": "user"}], r"results\[0\]\['role'\] must be 'tool'"),
    ],
)
def test_tool_results_must_answer_the_calls_one_each(tiny, monkeypatch, results, message):
    s = tiny.session("sys")
    _pending_tool_call(tiny, s, monkeypatch)  # one call
    pending, tokens = list(s.pending), list(s.tokens)
    with pytest.raises(engine.ChatError):  # Engine.chat refuses the same conversation
        tiny.chat([*s.messages, *({"role": "tool", "content": "x"} for _ in range(2))])
    with pytest.raises(ValueError, match=message):
        s.send_tool_results(results, max_tokens=MAX_TOKENS)
    assert s.pending == pending and s.history == [] and s.tokens == tokens
    turn = s.send_tool_results([{"content": "21", "role": "tool"}], max_tokens=MAX_TOKENS)
    ref = engine.load("tiny").chat([*s.messages[:-1]], tools=TOOLS, max_tokens=MAX_TOKENS,
                                   warm=False)  # fmt: skip
    assert (turn.prompt_ids, turn.token_ids) == (ref.prompt_ids, ref.token_ids)


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"validate": 5}, TypeError, "validate must be a callable taking the Turn, or None"),
        ({"ignore_eos": "no"}, TypeError, "ignore_eos must be True or False, got 'no'"),
        ({"top_logprobs": 5}, ValueError, "top_logprobs needs logprobs=True"),
        ({"top_logprobs": 99}, ValueError, "top_logprobs must be an integer from 0 to 20"),
        ({"logprobs": 0}, TypeError, "logprobs must be True or False, got 0"),
    ],
)
def test_bad_turn_options_raise_at_the_call_before_any_work(tiny, options, error, message):
    s = tiny.session("sys")
    s.send(QUESTIONS[0], max_tokens=MAX_TOKENS)
    tokens, snaps = list(s.tokens), dict(s.seq.snapshots)
    with pytest.raises(error, match=message):
        s.stream(QUESTIONS[1], max_tokens=MAX_TOKENS, **options)  # at the call: nothing ran
    with pytest.raises(error, match=message):
        s.regenerate(max_tokens=MAX_TOKENS, **options)
    assert s.tokens == tokens and s.seq.snapshots == snaps and len(s.history) == 1


@pytest.mark.parametrize("extra", [0, 1, 30_000])
def test_max_tokens_beyond_the_context_window_says_so(tiny, extra):
    s = tiny.session("sys", context_window=300)
    verb = "fills" if extra == 0 else "exceeds"
    with pytest.raises(ValueError, match=f"max_tokens {300 + extra} {verb} the context window "
                                         r"\(300 tokens\)"):  # fmt: skip
        s.send("hi", max_tokens=300 + extra)
    assert s.history == [] and s.tokens == []


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"max_exchanges": -1}, ValueError, "max_exchanges must be >= 0, got -1"),
        ({"max_exchanges": 2.5}, TypeError, "max_exchanges must be an integer"),
        ({"max_tokens": 0}, ValueError, "max_tokens must be >= 1"),
        ({"context_window": "4k"}, TypeError, "context_window must be an integer"),
        ({"context_window": 262_145}, ValueError,
         r"context_window 262145 is past tiny's 262144 positions \(max_position_embeddings"),
        ({"enable_thinking": "yes"}, TypeError, "enable_thinking must be True, False or None"),
        ({"preserve_thinking": 1}, TypeError, "preserve_thinking must be True, False or None"),
        ({"tools": {"name": "f"}}, TypeError, "tools must be a list"),
        ({"system": ["sys"]}, TypeError, "system must be a string or None, got list"),
        ({"max_tokens": 40_000}, ValueError, r"max_tokens 40000 exceeds the context window"),
        ({"max_tokens": 300, "context_window": 300}, ValueError,
         r"max_tokens 300 fills the context window \(300 tokens\)"),
        ({"tools": ["x"]}, ValueError, r"tools\[0\]'?: a tool must be an object, got str"),
        ({"tools": [{"type": "function", "function": {}}]}, ValueError,
         r"tools\[0\].function.name'?: the function name must be a non-empty string"),
    ],
)  # fmt: skip
def test_bad_session_options_raise_when_the_session_is_made(tiny, options, error, message):
    with pytest.raises(error, match=message):
        tiny.session(**{"system": "sys", **options})


class StopAfter:
    """Greedy, but picks the stop token at pick `n + 1`: an answer that ends by itself (a
    callable that is not a `Sampler`: the decode loop calls it for every pick)."""

    reads_history = False

    def __init__(self, eng, n):
        self.greedy = Sampler(SamplingParams())
        self.stop, self.n, self.picks = eng.stop_ids[0], n, 0

    def __call__(self, logits, recent):
        self.picks += 1
        return mx.array(self.stop) if self.picks > self.n else self.greedy(logits, recent)


@pytest.mark.parametrize("n", [0, 1, 3])
def test_decoding_ahead_never_leaves_the_stop_token_in_the_cache(tiny, monkeypatch, n):
    s = tiny.session("sys")
    monkeypatch.setattr("engine.session.Sampler", lambda p: StopAfter(tiny, n))
    turn = s.send(QUESTIONS[0], max_tokens=MAX_TOKENS)
    monkeypatch.undo()
    assert turn.finish_reason == "stop" and len(turn.token_ids) == n
    assert turn.token_ids == fresh_greedy(tiny, turn.prompt_ids, n)[0]
    # The caches hold the prompt and the answer, not the stop token fed ahead.
    held = len(turn.prompt_ids) + n
    assert len(s.seq.tokens) == held and {c.offset for c in s.seq.caches} == {held}
    nxt = s.send(QUESTIONS[1], max_tokens=MAX_TOKENS)
    assert nxt.token_ids == fresh_greedy(tiny, nxt.prompt_ids, MAX_TOKENS)[0]
    assert nxt.stats.reused_tokens > 0


# ----- randomized scripts -----------------------------------------------------------------


class ScriptedSampler:
    """Emits a fixed tool call, then the stop token: a model that calls a tool."""

    reads_history = False  # decoding runs ahead, and undoes the step it fed the stop token

    def __init__(self, eng, text):
        self.ids = eng.tokenizer.encode(text) + [eng.stop_ids[0]]
        self.i = 0

    def __call__(self, logits, recent):
        self.i += 1
        return mx.array(self.ids[min(self.i - 1, len(self.ids) - 1)])


TOOL_CALL = (
    "Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n北京\n"
    "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


def _script(rng: random.Random) -> list[str]:
    actions = ["send"] * 6 + ["regenerate", "edit", "tool", "fail", "interrupt"]
    return [rng.choice(actions) for _ in range(rng.randint(1, 12))]


@pytest.mark.parametrize("seed", range(10))
def test_randomized_scripts_are_exact(tiny, mlx_lm_model, first_logits, monkeypatch, seed):
    rng = random.Random(seed)
    thinking = rng.choice([True, False, None])
    budgeted = rng.random() < 0.3
    eng = tiny
    if rng.random() < 0.3:  # snapshot eviction under a tiny byte budget
        eng = engine.load("tiny", cache_bytes=rng.choice([0, 200_000, 600_000]))
    s = eng.session(
        rng.choice(["You are a helpful assistant.", "简洁地回答。", None]),
        max_exchanges=rng.choice([1, 2, 6]),
        enable_thinking=thinking,
        context_window=rng.choice([220, 300]) if budgeted else None,
    )
    use_mlx_lm = seed < 3  # mlx-lm agrees on a subset (it is the slowest reference)
    for action in _script(rng):
        q = rng.choice(QUESTIONS)
        before = [list(e) for e in s.history]
        if action == "fail":
            undo = _fail_after(monkeypatch, eng, rng.randint(1, 4))
            with pytest.raises(Boom):
                s.send(q * rng.randint(1, 6), max_tokens=MAX_TOKENS)
            undo()
            assert s.history == before
            continue
        if action == "interrupt":
            stream = s.stream(q, max_tokens=MAX_TOKENS)
            next(stream, None)
            stream.close()
            assert s.history == before
            continue
        if action == "tool":
            thinks = s.render([{"role": "user", "content": q}], 1).text.endswith("<think>\n")
            text = ("I should look it up.\n</think>\n\n" if thinks else "") + TOOL_CALL
            monkeypatch.setattr("engine.session.Sampler", lambda p, t=text: ScriptedSampler(eng, t))
            call = s.send(q, max_tokens=200, tools=TOOLS)
            monkeypatch.setattr("engine.session.Sampler", Sampler)
            assert [c.name for c in call.tool_calls] == ["get_weather"], call.tool_call_error
            assert call.tool_calls[0].arguments == {"city": "北京", "days": 3}
            turn = s.send_tool_results(['{"temp": 21}'], max_tokens=MAX_TOKENS)
            # the tool-result turn reuses the cache through the call's "<|im_start|>assistant\n"
            assert turn.stats.reused_tokens >= len(call.prompt_ids) - 8
        elif action == "regenerate" and s.history:
            turn = s.regenerate(max_tokens=MAX_TOKENS)
        elif action == "edit" and s.history:
            turn = s.edit_last(q, max_tokens=MAX_TOKENS)
        else:
            turn = s.send(q, max_tokens=MAX_TOKENS)
        check_turn(eng, turn, first_logits[-1], mlx_lm_model if use_mlx_lm else None)
        if budgeted:
            assert len(turn.prompt_ids) + MAX_TOKENS <= s.context_window
        assert len(s.history) <= 12 and s.pending == []
    if eng is not tiny:
        others = eng.budget.used() - s.seq.live_bytes
        assert others <= eng.budget.max_bytes  # only the active live cache may exceed it


def test_sessions_share_one_model_and_evictions_stay_exact(first_logits):
    eng = engine.load("tiny", cache_bytes=300_000)
    a, b = eng.session("A"), eng.session("B")
    for q in QUESTIONS[:4]:
        for s in (a, b):
            turn = s.send(q, max_tokens=MAX_TOKENS)
            check_turn(eng, turn, first_logits[-1])
            assert eng.budget.used() - s.seq.live_bytes <= eng.budget.max_bytes
    assert eng.budget.evictions > 0


# ----- a 20-turn replay with planted facts ------------------------------------------------


def test_twenty_turn_replay_keeps_facts_while_in_the_window(tiny):
    s = tiny.session("You are a helpful assistant.", max_exchanges=6)
    script = ["My order number is 48213.", "The code word is PELICAN."] + [
        QUESTIONS[i % len(QUESTIONS)].replace("48213", "x").replace("PELICAN", "y")
        for i in range(2, 20)
    ]
    order_in, word_in = [], []
    for i, q in enumerate(script, start=1):
        turn = s.send(q, max_tokens=3)
        prompt = tiny.tokenizer.decode(turn.prompt_ids)
        order_in.append("48213" in prompt)
        word_in.append("PELICAN" in prompt)
        assert turn.stats.dropped_exchanges == max(0, i - 1 - 6)
    # Planted at turn 1, the order number is in the window through turn 7 (history holds
    # exchanges 1..6) and gone from turn 8, when the window drops exchange 1.
    assert order_in == [True] * 7 + [False] * 13
    # The code word, planted at turn 2, leaves at turn 9.
    assert word_in == [False] + [True] * 7 + [False] * 12

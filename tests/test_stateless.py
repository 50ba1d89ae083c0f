"""`Engine.chat(messages)`: the stateless API, the server's implementation and its reuse.

References: a fresh full prefill of the turn's prompt ids (`fresh_greedy`), a `Session` fed
the same history, the HTTP server on another engine for the same requests, and reuse points
computed from the prompts' own boundaries (`expected_reuse`).
"""

from __future__ import annotations

import threading

import httpx
import pytest
from helpers import CALL, QUESTIONS, RESULT, TOOLS, fresh_greedy

import engine
from engine.runtime.pool import BRANCH_MIN, GRID, GRID_POINTS
from engine.serving.completion import parse_request
from engine.serving.server import BackgroundServer, ServerConfig

MAX_TOKENS = 4


def expected_reuse(previous: list[int], points: set[int], ids: list[int]) -> int:
    """The deepest of a previous prompt's snapshot `points` within the common prefix (the last
    token of `ids` is always recomputed: its logits start the answer)."""
    common = 0
    while common < min(len(previous), len(ids)) and previous[common] == ids[common]:
        common += 1
    return max((p for p in points if p <= min(common, len(ids) - 1)), default=0)


@pytest.mark.parametrize("variant", ["plain", "thinking", "tools", "window"])
def test_ten_turns_resent_in_full_equal_server_session_and_fresh_prefill(variant):
    options = {}  # the same for Engine.chat and the Session
    if variant == "thinking":
        options = {"enable_thinking": True}
    elif variant == "tools":
        options = {"tools": TOOLS}
    elif variant == "window":
        options = {"max_exchanges": 2}
    session_options = {"max_exchanges": 100, **options}  # the stateless default keeps all
    eng, other = engine.load("tiny"), engine.load("tiny")  # fresh pools: equal starting points
    session = other.session("You answer briefly.", **session_options)
    messages = [{"role": "system", "content": "You answer briefly."}]
    body = {"max_tokens": MAX_TOKENS, "temperature": 0}
    if variant == "thinking":
        body["chat_template_kwargs"] = {"enable_thinking": True}
    if variant == "tools":
        body["tools"] = TOOLS
    server = None
    if variant != "window":  # the server never trims: it gets the same requests otherwise
        server = BackgroundServer(other, ServerConfig(port=0, warm=False)).start()
    try:
        for i, q in enumerate(QUESTIONS[:10]):
            user = {"role": "user", "content": q}
            if variant == "tools" and i == 4:  # the client's history says the model called
                messages += [user, CALL, {"role": "tool", "content": RESULT}]
                session.pending = [user, CALL]
                alone = session.send_tool_results([RESULT], max_tokens=MAX_TOKENS)
            else:
                messages.append(user)
                alone = session.send(q, max_tokens=MAX_TOKENS)
            turn = eng.chat(messages, max_tokens=MAX_TOKENS, warm=False, **options)
            assert turn.prompt_ids == alone.prompt_ids
            assert turn.token_ids == alone.token_ids
            assert turn.token_ids == fresh_greedy(eng, turn.prompt_ids, MAX_TOKENS)[0]
            assert turn.stats.prompt_tokens == len(turn.prompt_ids)
            assert turn.stats.reused_tokens + turn.stats.prefilled_tokens == len(turn.prompt_ids)
            if i:
                assert turn.stats.reused_tokens > 0
            if server is not None:
                r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                               json={"messages": messages, **body}).json()  # fmt: skip
                assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == (
                    turn.stats.reused_tokens
                )
                assert r["usage"]["prompt_tokens"] == turn.stats.prompt_tokens
                assert r["choices"][0]["message"]["content"] == turn.text
            if variant == "window":
                assert turn.stats.dropped_exchanges == max(0, i - 2)
            messages.append(turn.message())
    finally:
        if server is not None:
            server.stop()


def snapshot_points(prompt) -> set[int]:
    """The contract `engine.stateless.snapshot_points` implements, restated from the prompt's
    boundaries: the system block's end, every boundary from the last user message on, and
    the last `GRID_POINTS` of every `GRID` tokens inside the system block and from that
    message's start to the answer's."""
    b = prompt.boundaries
    users = [i for i, m in enumerate(prompt.messages) if m["role"] == "user"]
    first = b.message_starts[users[-1]]
    grid = list(range(first + GRID, b.generation_start, GRID))[-GRID_POINTS:]
    grid += list(range(GRID, b.system_end, GRID))[-GRID_POINTS:]
    return {b.system_end} | {p for p in b.points() if p >= first} | set(grid)


def test_interleaved_conversations_and_a_branch_reuse_what_they_share_and_no_more():
    eng = engine.load("tiny")

    def render(messages):
        return eng.stateless.renderer.render(parse_request({"messages": messages}))

    def boundaries(messages):
        return render(messages).boundaries

    system = {"role": "system", "content": "Shared system prompt."}
    a, b = [system], [system]
    seen: list[tuple[list[int], set[int]]] = []  # every prompt sent, with its snapshot points

    def send(messages):
        bs = boundaries(messages)
        turn = eng.chat(messages, max_tokens=MAX_TOKENS, warm=False)
        assert turn.token_ids == fresh_greedy(eng, turn.prompt_ids, MAX_TOKENS)[0]
        best = max((expected_reuse(p, pts, turn.prompt_ids) for p, pts in seen), default=0)
        assert turn.stats.reused_tokens == best  # what is shared, nothing more
        seen.append((turn.prompt_ids, snapshot_points(render(messages)) | {len(turn.prompt_ids)}))
        return turn, bs

    a_generation_start = 0
    for k in range(3):
        a.append({"role": "user", "content": QUESTIONS[k]})
        turn, bs = send(a)
        assert turn.stats.reused_tokens == a_generation_start  # all but A's last answer
        a_generation_start = bs.generation_start
        a.append(turn.message())
        b.append({"role": "user", "content": QUESTIONS[k + 5]})
        turn, bs = send(b)
        if k == 0:
            assert turn.stats.reused_tokens == bs.system_end  # the shared system block only
        b.append(turn.message())
    # A branch: A's second question edited. It shares A up to that message, no further.
    branch = a[:3] + [{"role": "user", "content": "An edited second question."}]
    turn, bs = send(branch)
    assert turn.stats.reused_tokens == bs.message_starts[-1]  # up to the edited message
    # A goes on where it was: the branch took another sequence, not A's.
    a.append({"role": "user", "content": QUESTIONS[8]})
    turn, _ = send(a)
    assert turn.stats.reused_tokens == a_generation_start


def test_a_sliding_window_snapshots_only_where_a_later_request_resumes():
    """A client that keeps two exchanges re-prefills everything after the system block once
    its window slides. That prefill snapshots at the system block's end and from the last user
    message on, not at the older messages' boundaries (each a cost on every such turn, and
    unreachable after the next slide); answers equal a fresh prefill, and a branch at an older
    message reuses the system block."""
    eng = engine.load("tiny")
    system = {"role": "system", "content": "A sliding window."}
    history: list[dict] = []

    def render(messages):
        return eng.stateless.renderer.render(parse_request({"messages": messages}))

    for k in range(5):
        messages = [system, *history[-4:], {"role": "user", "content": QUESTIONS[k]}]
        prompt = render(messages)
        turn = eng.chat(messages, max_tokens=MAX_TOKENS, warm=False)
        assert turn.token_ids == fresh_greedy(eng, turn.prompt_ids, MAX_TOKENS)[0]
        history += [messages[-1], turn.message()]
        if k < 3:
            continue
        b = prompt.boundaries
        assert turn.stats.reused_tokens == b.system_end  # the window slid past the old answer
        (seq,) = [
            s for s in eng.stateless.pool.sequences if s.tokens[: len(prompt.ids)] == prompt.ids
        ]
        taken = {p for p in seq.snapshots if p < len(prompt.ids)}
        assert taken == snapshot_points(prompt) - {0}
        assert len(b.points() - taken) >= 4  # the older messages' boundaries were skipped
    # an edit of the first kept question (an older message): shares the system block only
    branch = messages[:1] + [{"role": "user", "content": "An edited older question."}]
    turn = eng.chat(branch, max_tokens=MAX_TOKENS, warm=False)
    assert turn.stats.reused_tokens == render(branch).boundaries.system_end
    assert turn.token_ids == fresh_greedy(eng, turn.prompt_ids, MAX_TOKENS)[0]


def test_prompts_sharing_a_document_snapshot_where_they_fork_and_a_third_resumes_there():
    """Requests that paste the same document with different questions fork inside the user
    message, where no boundary lies. The second prefills everything after the system block and
    leaves a snapshot at the fork (`pool.BRANCH_MIN` tokens or more past the last one); a third
    resumes there. Answers equal a fresh prefill. (The document is shorter than the grid of
    snapshots that a longer one gets: see the next test.)"""
    eng = engine.load("tiny")
    system = {"role": "system", "content": "Answer from the document."}
    document = " ".join(f"Clause {k}: the tenant keeps garden {k} tidy." for k in range(16))
    turns = []
    for question in ("What does clause 3 say?", "Who keeps the gardens?", "Is it tidy?"):
        messages = [system, {"role": "user", "content": f"{document}\n\n{question}"}]
        turn = eng.chat(messages, max_tokens=MAX_TOKENS, warm=False)
        assert turn.token_ids == fresh_greedy(eng, turn.prompt_ids, MAX_TOKENS)[0]
        turns.append(turn)
    first, second, third = (t.prompt_ids for t in turns)
    fork = max(n for n in range(len(second)) if first[:n] == second[:n])
    request = parse_request({"messages": [system, {"role": "user", "content": "?"}]})
    system_end = eng.stateless.renderer.render(request).boundaries.system_end
    assert turns[1].stats.reused_tokens == system_end
    assert BRANCH_MIN <= fork - system_end < GRID
    assert third[:fork] == first[:fork] and third[fork] not in (first[fork], second[fork])
    assert turns[2].stats.reused_tokens == fork


def test_a_question_on_a_long_document_resumes_on_the_grid_near_the_fork():
    """A pasted document longer than the grid (`pool.GRID`): the first request snapshots
    inside its message every GRID tokens (the last `GRID_POINTS` points, no more), so the
    second question on the same document resumes at the grid point below the fork, not after
    the system block. Answers equal a fresh prefill."""
    eng = engine.load("tiny")
    system = {"role": "system", "content": "Answer from the document."}
    document = " ".join(f"Clause {k}: the tenant keeps garden {k} tidy." for k in range(150))
    turns = []
    for question in ("What does clause 3 say?", "Who keeps the gardens?"):
        messages = [system, {"role": "user", "content": f"{document}\n\n{question}"}]
        turns.append(eng.chat(messages, max_tokens=MAX_TOKENS, warm=False))
        assert turns[-1].token_ids == fresh_greedy(eng, turns[-1].prompt_ids, MAX_TOKENS)[0]
    first, second = (t.prompt_ids for t in turns)
    fork = max(n for n in range(len(second)) if first[:n] == second[:n])
    request = parse_request({"messages": [system, {"role": "user", "content": "?"}]})
    message = eng.stateless.renderer.render(request).boundaries.system_end  # the user's start
    assert fork - message > (GRID_POINTS + 1) * GRID  # more grid than the points kept
    grid = {message + GRID * i for i in range(1, (fork - message) // GRID + 1)}
    kept = {p for s in eng.stateless.pool.sequences for p in s.snapshots} & grid
    assert len(kept) == GRID_POINTS and min(kept) == max(grid) - GRID * (GRID_POINTS - 1)
    assert turns[1].stats.reused_tokens == max(grid) > fork - GRID
    eng.close()


def test_a_long_system_prompt_that_differs_near_its_end_resumes_on_its_grid():
    """Conversations whose long system prompt (instructions, tools) differs only in its last
    line (a date): the first snapshots inside the system block on the grid, so the second
    resumes at the grid point below the fork instead of prefilling from scratch."""
    eng = engine.load("tiny")
    rules = " ".join(f"Rule {k}: answer politely and cite clause {k}." for k in range(80))
    turns = []
    for day in (7, 8):
        system = {"role": "system", "content": f"{rules}\nToday is December {day}."}
        messages = [system, {"role": "user", "content": QUESTIONS[0]}]
        turns.append(eng.chat(messages, max_tokens=MAX_TOKENS, warm=False))
        assert turns[-1].token_ids == fresh_greedy(eng, turns[-1].prompt_ids, MAX_TOKENS)[0]
    first, second = (t.prompt_ids for t in turns)
    fork = max(n for n in range(len(second)) if first[:n] == second[:n])
    assert fork > 2 * GRID
    assert turns[1].stats.reused_tokens == fork // GRID * GRID
    eng.close()


def test_the_engine_byte_budget_holds_for_the_pool():
    eng = engine.load("tiny", cache_bytes=2_500_000)
    conversations = [[{"role": "system", "content": f"Conversation {k}."}] for k in range(4)]
    for i in range(3):
        for k, messages in enumerate(conversations):
            messages.append({"role": "user", "content": QUESTIONS[(i + k) % len(QUESTIONS)]})
            turn = eng.chat(messages, max_tokens=MAX_TOKENS, warm=False)
            assert turn.token_ids == fresh_greedy(eng, turn.prompt_ids, MAX_TOKENS)[0]
            # Between calls nothing is exempt: every sequence and snapshot fits the budget.
            assert eng.budget.used() <= eng.budget.max_bytes
            messages.append(turn.message())
    assert eng.budget.evictions > 0


def test_threads_chatting_at_once_get_the_answers_they_get_alone(tiny):
    conversations = [
        [{"role": "system", "content": f"Thread {k}."}, {"role": "user", "content": q}]
        for k, q in enumerate(QUESTIONS[:4])
    ]
    alone = [tiny.chat(m, max_tokens=MAX_TOKENS).token_ids for m in conversations]
    results, errors = {}, []
    barrier = threading.Barrier(len(conversations))

    def run(k):
        try:
            barrier.wait(60)
            *pieces, turn = tiny.chat_stream(conversations[k], max_tokens=MAX_TOKENS)
            assert "".join(pieces).strip() == turn.text
            results[k] = turn.token_ids
        except BaseException as e:  # reported below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(conversations))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert [results[k] for k in range(len(conversations))] == alone


def test_choices_are_the_seeded_answers_and_prefill_the_prompt_once(tiny):
    messages = [{"role": "system", "content": "Sample."}, {"role": "user", "content": "Three?"}]
    options = {"temperature": 1.0, "max_tokens": 6, "warm": False}
    choices = tiny.chat_choices(messages, 3, seed=11, **options)
    singles = [tiny.chat(messages, seed=11 + i, **options) for i in range(3)]
    assert [c.token_ids for c in choices] == [s.token_ids for s in singles]
    assert len({tuple(c.token_ids) for c in choices}) == 3
    ids = tiny.stateless.prepare(parse_request({"messages": messages})).prompt
    header = len(ids.ids) - ids.boundaries.generation_start  # all the later choices prefill
    assert [c.stats.prefilled_tokens for c in choices[1:]] == [header, header]
    for n, param in ((0, "n"), (9, "n"), ("2", "n")):
        with pytest.raises(engine.ChatError) as e:
            tiny.chat_choices(messages, n)
        assert e.value.param == param
    with pytest.raises(engine.ChatError) as e:  # a request error names its field, as chat's
        tiny.chat_choices(messages, 2, temperature=-1)
    assert e.value.param == "temperature"
    dead_end = {"type": "regex", "regex": r"a[^\s\S]b"}  # found after the first token
    with pytest.raises(engine.ChatError, match="no answer can match") as e:
        tiny.chat_choices(messages, 2, response_format=dead_end, max_tokens=4, warm=False)
    assert e.value.param == "response_format"
    assert tiny.chat_choices(messages, 2, seed=11, **options)[1].token_ids == singles[1].token_ids


def test_bad_input_raises_chat_error_naming_it_before_any_work(tiny):
    ok = [{"role": "user", "content": "hi"}]
    cases = [
        ([{"role": "user", "content": ""}], {}, "messages[0].content"),
        ([], {}, "messages"),
        (ok, {"temperature": 3}, "temperature"),
        (ok, {"tool_choice": "required"}, "tool_choice"),
        (ok, {"max_tokens": 0}, "max_tokens"),
        (ok, {"max_tokens": 10, "context_window": 20}, "max_tokens"),  # 13 + 10 > 20
        (ok, {"max_exchanges": -1}, "max_exchanges"),
        (ok, {"context_window": 262_145}, "context_window"),  # past max_position_embeddings
        (ok, {"context_window": 0}, "context_window"),
        (ok, {"warm": "no"}, "warm"),
        (ok, {"top_logprobs": 3}, "top_logprobs"),
        (ok, {"logit_bias": {5: 200}}, "logit_bias"),
        (ok, {"logit_bias": {"x": 1}}, "logit_bias"),
        (ok, {"logit_bias": {tiny.tokenizer.vocab_size: 1}}, "logit_bias"),
    ]
    for messages, options, param in cases:
        with pytest.raises(engine.ChatError) as e:
            tiny.chat_stream(messages, **options)  # raises at the call, not at the first next
        assert e.value.param == param, (options, e.value)
    # A good one takes token ids as ints, as Session.send does.
    ids = tiny.stateless.prepare(parse_request({"messages": ok})).prompt.ids
    plain, _ = fresh_greedy(tiny, ids, 3)
    want, _ = fresh_greedy(tiny, ids, 3, bias={plain[0]: -100})
    assert tiny.chat(ok, max_tokens=3, logit_bias={plain[0]: -100}, warm=False).token_ids == want
    long = [{"role": "user", "content": "word " * 400}]
    with pytest.raises(engine.ChatError, match="maximum context length is 100 tokens"):
        tiny.chat(long, context_window=100)
    with pytest.raises(ValueError, match="context window 100 minus 8 tokens reserved"):
        tiny.chat(long, context_window=100, max_exchanges=6, max_tokens=8)


def test_stop_strings_cut_the_streamed_text_and_closing_early_keeps_a_valid_pool(tiny):
    messages = [{"role": "user", "content": "Say something long."}]
    full = tiny.chat(messages, max_tokens=12, warm=False)
    raw = tiny.tokenizer.decode(full.token_ids)
    stop = raw.strip()[3:5]
    *pieces, cut = tiny.chat_stream(messages, max_tokens=12, stop=stop, warm=False)
    assert stop not in "".join(pieces)
    assert "".join(pieces).strip() == cut.text and cut.finish_reason == "stop"
    assert raw.startswith("".join(pieces))
    stream = tiny.chat_stream(messages, max_tokens=50, warm=False)
    next(stream)
    stream.close()  # stops at the next token
    again = tiny.chat(messages, max_tokens=12, warm=False)
    assert again.token_ids == full.token_ids and again.stats.reused_tokens > 0


def test_penalties_and_the_checkpoints_sampling_defaults_are_taken_as_the_server_takes_them(
    tiny, server
):
    """`presence_penalty`/`frequency_penalty` reach the sampler as the server's and a Session's
    do, and `**eng.sampling_defaults` (Qwen3.5's recommendation has presence_penalty 1.5) is
    accepted: greedy and seeded answers equal the server's and a Session's."""
    question = "Say something again and again."
    messages = [{"role": "user", "content": question}]

    def served(**options) -> str:
        body = {"messages": messages, "max_tokens": 12, **options}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()
        return r["choices"][0]["message"]["content"]

    plain = tiny.chat(messages, max_tokens=12, warm=False)
    for options in (
        {"temperature": 0, "presence_penalty": -1.0, "frequency_penalty": 0.3},
        {**tiny.sampling_defaults, "seed": 7},
    ):
        turn = tiny.chat(messages, max_tokens=12, warm=False, **options)
        alone = tiny.session(None).send(question, max_tokens=12, **options)
        assert turn.token_ids == alone.token_ids and turn.text == served(**options)
        assert turn.token_ids != plain.token_ids  # the options made a difference
    assert tiny.sampling_defaults["presence_penalty"] == 1.5


def _nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


DEEP_TOOL = {"type": "function", "function": {"name": "f", "parameters": _nested(1000)}}


@pytest.mark.parametrize(
    "messages, options, param",
    [
        ([{"role": "user", "content": "a\udc80"}], {}, "messages[0].content"),
        ([{"role": "system", "content": "\udc80"}, {"role": "user", "content": "x"}], {},
         "messages[0].content"),
        ([{"role": "user", "content": [{"type": "text", "text": "caf\udce9"}]}], {},
         "messages[0].content[0].text"),
        ([{"role": "user", "content": "x"}],
         {"tools": [{"type": "function", "function": {"name": "f", "description": "\udc80"}}]},
         "tools[0].function.description"),
        ([{"role": "user", "content": "x"}], {"stop": ["\ud800"]}, "stop[0]"),
        ([{"role": "user", "content": "x"}], {"tools": [DEEP_TOOL]},
         "tools[0].function.parameters" + ".properties.a" * 30),
    ],
    ids=["user", "system", "text-part", "tool-description", "stop", "deep-tool-schema"],
)  # fmt: skip
def test_text_no_tokenizer_takes_and_deep_nesting_are_chat_errors_naming_them(tiny, messages,
                                                                               options, param):  # fmt: skip
    """What the server's body check refuses (lone surrogates, nesting past 64 levels) is a
    ChatError naming the field at the call, not a TypeError from the tokenizer or a
    RecursionError from the template."""
    completed = tiny.stateless.completed
    with pytest.raises(engine.ChatError) as e:
        tiny.chat_stream(messages, max_tokens=MAX_TOKENS, **options)
    assert e.value.param == param and e.value.code == "invalid_value"
    assert "lone surrogate" in str(e.value) or "nested deeper than 64 levels" in str(e.value)
    assert tiny.stateless.completed == completed  # nothing ran

"""The OpenAI-compatible server on `tiny`, live on 127.0.0.1, through the official client.

Exactness reference: a fresh full prefill of the same prompt ids plus greedy decoding, with
no cache, no snapshots and no server (`fresh_answer`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from helpers import SERVER_WINDOW, TOOLS, fresh_greedy, serve_app
from helpers import openai_client as client

from engine.checkpoints.tokenizer import StreamDecoder
from engine.runtime.generate import decode, prefill
from engine.runtime.sampling import Sampler, SamplingParams
from engine.serving.completion import MAX_CHOICES, OutputText, Renderer, parse_request
from engine.serving.server import BackgroundServer, ServerApp, ServerConfig

WINDOW = SERVER_WINDOW  # a small context window keeps the too-long-prompt check cheap
MAX_TOKENS = 6  # decoding dominates test time (~40 ms a token on 2 busy cores)


def ask(c: openai.OpenAI, messages: list, **kw):
    # Plain greedy: the checkpoint's defaults (presence_penalty) would apply otherwise.
    kw = {"max_tokens": MAX_TOKENS, "temperature": 0, "presence_penalty": 0, **kw}
    return c.chat.completions.create(model="tiny", messages=messages, **kw)


def prompt_of(engine, messages: list, **body):
    return Renderer(engine).render(parse_request({"messages": messages, **body}))


def fresh_answer(engine, messages: list, max_tokens: int = MAX_TOKENS,
                 params: SamplingParams | None = None, **body) -> str:  # fmt: skip
    """The answer from a full prefill on empty caches (no snapshots, no reuse): greedy, or
    sampled with `params`."""
    prompt = prompt_of(engine, messages, **body)
    with engine.lock:  # the server's model thread may be between jobs: one user at a time
        caches = engine.model.make_caches()
        logits, _ = prefill(engine.model, caches, prompt.ids, 0)
        detok, raw = StreamDecoder(engine.tokenizer), ""
        for token in decode(
            engine.model, caches, logits, Sampler(params or SamplingParams()),
            max_tokens=max_tokens, stop_ids=engine.stop_ids, history=list(prompt.ids),
        ):  # fmt: skip
            if token in engine.stop_ids:
                break
            raw += detok.add(token)
        raw += detok.flush()
    out = OutputText(prompt.text.endswith("<think>\n"))
    out.add(raw)
    return out.message().content


def expected_reuse(previous, prompt) -> int:
    """Where a prompt resumes after `previous`: its deepest snapshot point within both.

    The server snapshots every prompt at the renderer's boundaries and at its end; the answer
    generated after it is re-rendered differently (no think block), so it never counts.
    """
    b = previous.boundaries
    points = {b.system_end, *b.message_starts, *b.assistant_starts, b.generation_start,
              len(previous.ids)}  # fmt: skip
    common = 0
    while common < min(len(previous.ids), len(prompt.ids)) and (
        previous.ids[common] == prompt.ids[common]
    ):
        common += 1
    return max(p for p in points if p <= min(common, len(prompt.ids) - 1))


def post(srv, body, **kw) -> httpx.Response:
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=30, **kw)


# ----- conversations ------------------------------------------------------------------------


def test_no_hidden_conversation_state(tiny, server):
    c = client(server)
    system = {"role": "system", "content": "You remember nothing between requests."}
    first = [system, {"role": "user", "content": "My order number is 48213."}]
    a1 = ask(c, first).choices[0].message.content
    ask(c, first + [{"role": "assistant", "content": a1}, {"role": "user", "content": "Thanks"}])
    alone = [system, {"role": "user", "content": "What is my order number?"}]
    second = ask(c, alone)
    with BackgroundServer(tiny, ServerConfig(port=0, context_window=WINDOW)) as fresh:
        reference = ask(client(fresh), alone)
    assert second.usage.prompt_tokens == reference.usage.prompt_tokens
    assert second.choices[0].message.content == reference.choices[0].message.content


def test_six_turns_reuse_everything_before_the_last_answer(tiny, server):
    c = client(server)
    messages = [{"role": "system", "content": "Six turns, resent in full each time."}]
    previous = None
    for turn in range(6):
        messages.append({"role": "user", "content": f"Question {turn}: tell me about {turn * 7}."})
        prompt = prompt_of(tiny, messages)
        r = ask(c, messages)
        assert r.usage.prompt_tokens == len(prompt.ids)
        if previous is not None:
            # Everything up to right after "<|im_start|>assistant\n" of the previous answer.
            expected = prompt.boundaries.assistant_starts[-1]
            assert expected == previous.boundaries.generation_start
            assert r.usage.prompt_tokens_details.cached_tokens == expected
            assert expected_reuse(previous, prompt) == expected
        answer = r.choices[0].message.content
        assert answer == fresh_answer(tiny, messages)
        messages.append({"role": "assistant", "content": answer})
        previous = prompt


def test_idle_warm_up_leaves_only_the_new_message(tiny):
    config = ServerConfig(port=0, context_window=WINDOW, warm=True)
    with BackgroundServer(tiny, config) as srv:
        c, worker = client(srv), srv.app.worker
        messages = [{"role": "system", "content": "Warm between requests."}]
        for turn in range(3):
            messages.append({"role": "user", "content": f"Question {turn}: what is {turn * 11}?"})
            prompt = prompt_of(tiny, messages)
            assert worker.idle.wait(30)  # the previous answer's warm-up is done
            r = ask(c, messages)
            if turn:
                # Only "<|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n" + think prefix.
                assert (
                    r.usage.prompt_tokens_details.cached_tokens
                    == prompt.boundaries.message_starts[-1]
                )
            answer = r.choices[0].message.content
            assert answer == fresh_answer(tiny, messages)
            messages.append({"role": "assistant", "content": answer})
        assert worker.warmed_tokens > 0


def test_tool_round_trip_keeps_reuse(tiny, server):
    c = client(server)
    tools = [{
        "type": "function",
        "function": {
            "name": "get_weather", "description": "Weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }]  # fmt: skip
    messages = [
        {"role": "system", "content": "You call tools."},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    first = prompt_of(tiny, messages, tools=tools)
    ask(c, messages, tools=tools)
    # The random model does not call tools: the client's history says it did.
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
        }]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
    ]  # fmt: skip
    second = prompt_of(tiny, messages, tools=tools)
    r = ask(c, messages, tools=tools)
    assert second.boundaries.assistant_starts[-1] == first.boundaries.generation_start
    # The tool-call step renders its (empty) think block like the generation prompt did, so
    # the whole first prompt is reused, not just up to its "<|im_start|>assistant\n".
    assert second.ids[: len(first.ids)] == first.ids
    assert r.usage.prompt_tokens_details.cached_tokens == len(first.ids)
    answer = r.choices[0].message.content
    assert answer == fresh_answer(tiny, messages, tools=tools)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And Rome?"}]
    third = prompt_of(tiny, messages, tools=tools)
    r = ask(c, messages, tools=tools)
    # The exchange is complete now: its tool-call step renders without the think block, so
    # the third prompt resumes right after that step's "<|im_start|>assistant\n".
    assert r.usage.prompt_tokens_details.cached_tokens == expected_reuse(second, third)
    assert expected_reuse(second, third) == third.boundaries.assistant_starts[0]


def test_stream_equals_non_stream_and_reports_usage(tiny, server):
    c = client(server)
    messages = [{"role": "user", "content": "Stream me something."}]
    plain = ask(c, messages, max_tokens=12)
    pieces, usage, finish = [], None, None
    for chunk in ask(c, messages, max_tokens=12, stream=True,
                     stream_options={"include_usage": True}):  # fmt: skip
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == plain.choices[0].message.content
    assert finish == plain.choices[0].finish_reason == "length"
    assert usage.prompt_tokens == plain.usage.prompt_tokens
    assert usage.completion_tokens == 12
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt, just sent


def test_n_choices_are_the_seeded_answers_and_prefill_the_prompt_once(tiny, server, monkeypatch):
    # n choices: choice i is the answer sampled with seed + i (a fresh prefill and decode on
    # empty caches is the reference), the prompt is prefilled once, and usage counts it once.
    import engine.stateless as stateless

    turns = []  # every answer the model thread finishes, in order
    make = stateless.make_turn
    monkeypatch.setattr(stateless, "make_turn",
                        lambda *a, **k: turns.append(make(*a, **k)) or turns[-1])  # fmt: skip
    c = client(server)
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Tell me about n choices, sampled three ways."}]  # fmt: skip
    body = {"temperature": 1.0, "seed": 41, "max_tokens": 8}
    r = ask(c, messages, n=3, **body)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    params = parse_request({"messages": messages, **body, "presence_penalty": 0},
                           tiny.sampling_defaults).params  # fmt: skip
    for i, ch in enumerate(r.choices):
        seeded = dataclasses.replace(params, seed=41 + i)
        assert ch.message.content == fresh_answer(tiny, messages, 8, seeded), i
    assert len({ch.message.content for ch in r.choices}) == 3  # distinct samples
    prompt = prompt_of(tiny, messages)
    assert r.usage.prompt_tokens == len(prompt.ids)
    assert r.usage.completion_tokens == sum(t.stats.generated_tokens for t in turns) == 24
    prefilled = sorted(t.stats.prefilled_tokens for t in turns)
    assert prefilled[-1] == len(prompt.ids) - r.usage.prompt_tokens_details.cached_tokens
    # the others resume at the first one's snapshot at the generation start: only the header
    # after it (the empty think block) is prefilled again
    assert prefilled[:2] == [len(prompt.ids) - prompt.boundaries.generation_start] * 2

    # Streamed: each choice's deltas add up to its answer; usage once, at the end.
    pieces, finish, usage = {}, {}, None
    for chunk in ask(c, messages, n=2, stream=True, stream_options={"include_usage": True},
                     **body):  # fmt: skip
        usage = chunk.usage or usage
        for ch in chunk.choices:
            pieces[ch.index] = pieces.get(ch.index, "") + (ch.delta.content or "")
            finish[ch.index] = ch.finish_reason or finish.get(ch.index)
    assert pieces == {i: r.choices[i].message.content for i in range(2)}
    assert finish == {0: "length", 1: "length"}
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt.ids), 16)


def test_the_queue_limit_counts_a_request_of_n_choices_once(tiny):
    # Each choice was checked against the queue as a request of its own: with max_queued 2,
    # n=4 on an idle server was a 503 "retry later" that no retry could pass.
    config = ServerConfig(port=0, max_queued=2, warm=False, prepare_grammar=False)
    with BackgroundServer(tiny, config) as srv:
        r = ask(client(srv), [{"role": "user", "content": "Four, please."}], n=4)
        assert [ch.index for ch in r.choices] == [0, 1, 2, 3]


def test_logit_bias_shifts_the_tokens_it_names(tiny, server):
    # The reference adds the bias to the model's logits in numpy before each greedy pick, on a
    # fresh prefill; -100 bans a token, +100 all but forces one.
    c = client(server)
    messages = [{"role": "user", "content": "Bias me."}]
    ids = prompt_of(tiny, messages).ids
    plain, _ = fresh_greedy(tiny, ids, MAX_TOKENS)
    for bias in ({plain[0]: -100, plain[2]: -100}, {plain[3]: 100}, {7: 4.5, plain[1]: -3.0}):
        want, _ = fresh_greedy(tiny, ids, MAX_TOKENS, bias=bias)
        r = ask(c, messages, logit_bias={str(k): v for k, v in bias.items()})
        assert r.choices[0].message.content == tiny.tokenizer.decode(want), bias
    assert plain[0] not in fresh_greedy(tiny, ids, MAX_TOKENS, bias={plain[0]: -100})[0]


def test_logit_bias_naming_a_token_twice_is_a_400(server):
    # "1" and "01" are the same token id: which bias applies is ambiguous (SamplingParams itself
    # refuses "logit_bias names a token twice"), yet the server kept the last one silently.
    messages = [{"role": "user", "content": "hi"}]
    for path, body in (("/v1/chat/completions", {"messages": messages}),
                       ("/v1/completions", {"prompt": "hi"})):  # fmt: skip
        body = {"model": "tiny", "max_tokens": 1, "logit_bias": {"1": 5, "01": -5}, **body}
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == "logit_bias"


def test_thinking_is_returned_as_reasoning_content(tiny, server):
    messages = [{"role": "user", "content": "Think first."}]
    body = {"extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}
    assert prompt_of(tiny, messages, chat_template_kwargs={"enable_thinking": True}).text.endswith(
        "<think>\n"
    )
    r = ask(client(server), messages, **body)
    message = r.choices[0].message
    # Eight random tokens never close the think block: all of it is reasoning.
    assert message.content == ""
    assert message.reasoning_content == fresh_answer_reasoning(tiny, messages)


def fresh_answer_reasoning(engine, messages):
    prompt = prompt_of(engine, messages, chat_template_kwargs={"enable_thinking": True})
    with engine.lock:
        caches = engine.model.make_caches()
        logits, _ = prefill(engine.model, caches, prompt.ids, 0)
        tokens = list(
            decode(
                engine.model,
                caches,
                logits,
                Sampler(SamplingParams()),
                max_tokens=MAX_TOKENS,
                stop_ids=engine.stop_ids,
                history=list(prompt.ids),
            )  # fmt: skip
        )
    assert not set(tokens) & set(engine.stop_ids) and len(tokens) == MAX_TOKENS
    out = OutputText(thinking=True)
    out.add(engine.tokenizer.decode(tokens))
    return out.message().reasoning


def test_stop_strings_cut_the_answer(server):
    c = client(server)
    messages = [{"role": "user", "content": "Say a long sentence."}]
    full = ask(c, messages, max_tokens=16).choices[0].message.content
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    expected = full[: full.index(stop)].strip()
    r = ask(c, messages, max_tokens=16, stop=[stop])
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in ask(c, messages, max_tokens=16, stop=stop, stream=True)
        if ch.choices
    )
    assert streamed == expected


@pytest.mark.parametrize("n", [1, 3])
def test_disconnect_mid_stream_stops_generation(tiny, server, n):
    messages = [{"role": "user", "content": "Talk for a long time."}]
    worker = server.app.worker
    done = worker.completed
    body = {"model": "tiny", "messages": messages, "max_tokens": 1500, "temperature": 0,
            "stream": True, "n": n}  # fmt: skip
    with httpx.Client(timeout=30) as h:
        with h.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            seen = [line for line, _ in zip(lines, range(4 + 2 * n))]
    assert all(line.startswith("data: ") or not line for line in seen)
    deadline = time.monotonic() + 20
    while worker.completed < done + n and time.monotonic() < deadline:
        time.sleep(0.02)
    assert worker.completed == done + n  # every choice stopped
    ids = prompt_of(tiny, messages).ids
    held = [s.tokens for s in worker.pool.sequences if s.tokens[: len(ids)] == ids]
    assert len(held) >= n and all(len(t) - len(ids) < 200 for t in held)  # long before 1500
    # The sequence is consistent: the same prompt now reuses it and answers exactly.
    r = ask(client(server), messages)
    assert r.usage.prompt_tokens_details.cached_tokens > 0
    assert r.choices[0].message.content == fresh_answer(tiny, messages)


# ----- stopping -----------------------------------------------------------------------------

LONG_STREAM = {"model": "tiny", "messages": [{"role": "user", "content": "Talk for a long time."}],
               "max_tokens": WINDOW - 64, "temperature": 0, "presence_penalty": 0, "stream": True}  # fmt: skip


def send_partial_body(url: str) -> socket.socket:
    """A client that sends its headers and 5 of the 100 body bytes it announces, then waits."""
    address = url.removeprefix("http://")
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {address}\r\nContent-Type: "
                 "application/json\r\nContent-Length: 100\r\n\r\n{\"mes".encode())  # fmt: skip
    return sock


def read_response(sock: socket.socket) -> tuple[int, dict]:
    """(status, JSON body) of the one response on `sock`, read until the server closes it."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head, "the server closed the connection without a response"
    return int(head.split()[1]), json.loads(body)


def test_a_body_that_does_not_arrive_in_time_is_a_408(tiny):
    config = ServerConfig(port=0, context_window=WINDOW, warm=False, prepare_grammar=False,
                          body_timeout=0.5)  # fmt: skip
    with BackgroundServer(tiny, config) as srv:
        with send_partial_body(srv.url) as sock:
            status, body = read_response(sock)  # and the connection is closed
        assert status == 408 and body["error"]["code"] == "request_timeout"
        assert "did not arrive within 0.5 s" in body["error"]["message"]
        assert ask(client(srv), [{"role": "user", "content": "hi"}]).choices  # it serves on


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "content-length"])
def test_a_body_too_large_is_a_413_and_the_connection_closes(tiny, chunked):
    """The rest of the body is never read: the connection is closed with the 413, not left
    waiting for bytes the client may still send."""
    config = ServerConfig(port=0, context_window=WINDOW, warm=False, prepare_grammar=False,
                          max_body_bytes=1000)  # fmt: skip
    with BackgroundServer(tiny, config) as srv:
        address = srv.url.removeprefix("http://")
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            length = "Transfer-Encoding: chunked" if chunked else "Content-Length: 5000"
            sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {address}\r\n"
                         f"{length}\r\n\r\n".encode())  # fmt: skip
            part = b'{"messages": "' + b"x" * 1500
            sock.sendall(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
            status, body = read_response(sock)  # until the server closes (socket timeout: 30 s)
        assert status == 413 and body["error"]["code"] == "body_too_large"
        assert ask(client(srv), [{"role": "user", "content": "hi"}]).choices  # it serves on


def stream_until_stopped(url: str, stop) -> list[str]:
    """The lines of a long stream after its first content: `stop()` is called there."""
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", url + "/v1/chat/completions", json=LONG_STREAM) as r:
            lines = (line for line in r.iter_lines() if line)
            assert '"role"' in next(lines)
            assert '"content"' in next(lines)  # a token: the generation runs
            stop()
            return list(lines)


def assert_stopped_by_shutdown(rest: list[str]) -> None:
    """The stream ended at once: an error event naming the shutdown, then [DONE]."""
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["error"]["code"] == "shutting_down"


def test_a_stop_cancels_running_requests_at_once(tiny):
    """A stop (what SIGTERM does: uvicorn's should_exit) while a long stream runs and another
    client has sent half its body: the stream ends with an error event and its job is
    cancelled, the half-sent body gets a 503, and the server stops. Before, the stream ran on
    and the body kept the connection open, until uvicorn's graceful timeout cut both."""
    config = ServerConfig(port=0, context_window=WINDOW, warm=False, prepare_grammar=False)
    srv = BackgroundServer(tiny, config).start()
    stopper = threading.Thread(target=srv.stop)
    try:
        with send_partial_body(srv.url) as sock:
            deadline = time.monotonic() + 30
            while not srv.app.reading and time.monotonic() < deadline:
                time.sleep(0.01)
            assert srv.app.reading  # the server waits for the rest of that body
            rest = stream_until_stopped(srv.url, stopper.start)
            status, body = read_response(sock)
    finally:
        if stopper.ident is None:
            stopper.start()
        stopper.join(60)
    assert_stopped_by_shutdown(rest)
    assert status == 503 and body["error"]["code"] == "shutting_down"
    assert srv.app.jobs and all(j.cancelled.is_set() and j.done.is_set() for j in srv.app.jobs)
    assert not srv._thread.is_alive()


def serve_process(log) -> subprocess.Popen:
    """`chatml serve` on tiny in a process of its own: the banner on stdout, the log in `log`."""
    return subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "serve", "--model", "tiny", "--port", "0",
         "--no-disk-cache", "--no-warm"],
        stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
    )  # fmt: skip


def test_sigterm_cancels_requests_and_exits(tiny, tmp_path):
    """`chatml serve` gets SIGTERM while it streams and while a client holds a half-sent
    body: the stream ends with an error event, the body gets a 503, the server exits 0."""
    log = tmp_path / "server.log"
    proc = serve_process(log)
    watchdog = threading.Timer(300, proc.kill)  # a hung server fails the test, not the run
    watchdog.start()
    try:
        url = proc.stdout.readline().split(" on ", 1)[1].strip().removesuffix("/v1")
        with send_partial_body(url) as sock:
            rest = stream_until_stopped(url, lambda: proc.send_signal(signal.SIGTERM))
            status, body = read_response(sock)
        assert proc.wait(60) == 0, log.read_text()  # before, the half-sent body held it
        assert "chatml serve: stopped by SIGTERM" in proc.stdout.read()
    finally:
        watchdog.cancel()
        proc.kill()
        proc.wait()
    assert_stopped_by_shutdown(rest)
    assert status == 503 and body["error"]["code"] == "shutting_down"


def test_a_stop_as_soon_as_the_banner_shows_is_clean(tmp_path):
    """SIGTERM the moment the banner is read: the handlers are in place before it (the
    default SIGTERM killed the process there), and the interpreter waits for llguidance's
    tokenizer build, which runs then (a daemon thread inside it crashed the exit, SIGSEGV)."""
    log = tmp_path / "server.log"
    proc = serve_process(log)
    try:
        assert " on http://" in proc.stdout.readline()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0, log.read_text()
        assert "chatml serve: stopped by SIGTERM" in proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()


# ----- errors -------------------------------------------------------------------------------


def test_api_key(tiny):
    with BackgroundServer(tiny, ServerConfig(port=0, api_key="s3cret")) as srv:
        with pytest.raises(openai.AuthenticationError):
            client(srv, "wrong").models.list()
        r = httpx.get(srv.url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(srv.url + "/health").status_code == 200  # health needs no key
        assert client(srv, "s3cret").models.list().data[0].id == "tiny"
        assert httpx.get(srv.url + "/metrics").status_code == 401  # metrics does
        metrics = scrape(srv, {"Authorization": "Bearer s3cret"})
        assert "chatml_answers_total" in metrics  # (the engine's, since tests share `tiny`)
        assert "chatml_disk_writes_total" not in metrics  # BackgroundServer attaches no disk


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {
                "messages": [
                    {"role": "system", "content": "s"},
                    {"role": "user", "content": "a"},
                    {"role": "tool", "content": "r"},
                ]
            },
            "messages[2].role",
        ),  # fmt: skip
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 5}, "stop"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": {}}, "tools"),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "chat_template_kwargs": {"enable_thinking": "yes"},
            },
            "chat_template_kwargs.enable_thinking",
        ),  # fmt: skip
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": WINDOW}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]},
            "functions",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "function_call": "auto"},
            "function_call",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"]},
            "modalities",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "audio": {"voice": "alloy"}}, "audio"),
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": [1]}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"a": 1}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"-1": 1}}, "logit_bias"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 100.5}},
            "logit_bias",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"999999999": -100}},
            "logit_bias",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "n": MAX_CHOICES + 1}, "n"),
    ],
)
def test_bad_requests_name_the_field(server, body, param):
    r = post(server, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]


def test_malformed_json_too_long_and_too_large(server):
    r = httpx.post(server.url + "/v1/chat/completions", content=b"{nope", timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    long = {"messages": [{"role": "user", "content": "word " * WINDOW}]}
    r = post(server, long)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert f"maximum context length is {WINDOW}" in r.json()["error"]["message"]
    huge = {"messages": [{"role": "user", "content": "x" * (4 << 20)}]}
    assert post(server, huge).status_code == 413
    with pytest.raises(openai.BadRequestError) as e:  # through the official client too
        ask(client(server), [{"role": "user", "content": "hi"}, {"role": "narrator"}])
    assert e.value.body["param"] == "messages[1].role"


class Records(logging.Handler):
    """The records of the given loggers (INFO and up, as their levels let through) while in
    use; `seen` is set by each."""

    def __init__(self, *names: str):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []
        self.seen = threading.Event()
        self.loggers = [logging.getLogger(name) for name in names]

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.seen.set()

    def __enter__(self) -> Records:
        for logger in self.loggers:
            logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        for logger in self.loggers:
            logger.removeHandler(self)


def test_a_client_gone_while_sending_its_body_is_one_line_in_the_log(server, caplog):
    # Before, Starlette's ClientDisconnect escaped the handler: a 500 and a full traceback
    # at ERROR, one per such client.
    caplog.set_level(logging.INFO, logger="chatml.server")
    with Records("chatml.server", "uvicorn.error") as log:
        send_partial_body(server.url).close()
        assert log.seen.wait(30)
        assert ask(client(server), [{"role": "user", "content": "hi"}]).choices  # serves on
    (record,) = log.records
    assert record.levelno == logging.INFO and record.exc_info is None
    assert record.getMessage() == "a client went away while sending its request body"


def test_an_internal_error_is_one_traceback(server, monkeypatch):
    def bug(self, raw):
        raise RuntimeError("a bug")

    monkeypatch.setattr(ServerApp, "_prepare", bug)
    with Records("chatml.server", "uvicorn.error") as log:
        r = post(server, {"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        assert log.seen.wait(30)  # logged after the answer is sent
    (record,) = log.records
    assert record.levelno == logging.ERROR and record.exc_info[1].args == ("a bug",)


def scrape(srv, headers: dict | None = None) -> dict[str, float]:
    """/metrics, parsed: each sample's value by name (the format checked on the way)."""
    r = httpx.get(srv.url + "/metrics", headers=headers or {})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    values, kinds = {}, {}
    for line in r.text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            kinds[name] = kind
        elif not line.startswith("# HELP "):
            name, value = line.split()
            assert kinds[name] in ("counter", "gauge") and name.startswith("chatml_")
            assert name.endswith("_total") == (kinds[name] == "counter")
            values[name] = float(value)
    return values


def test_metrics_count_what_the_answers_report(server):
    before = scrape(server)
    c = client(server)
    asked = [[{"role": "user", "content": f"Metrics, request {k}."}] for k in (1, 2, 1)]
    usages = [ask(c, messages).usage for messages in asked]
    after = scrape(server)

    def grew(name: str) -> float:
        return after[f"chatml_{name}"] - before[f"chatml_{name}"]

    assert grew("answers_total") == grew("generations_total") == 3
    assert grew("prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert grew("prompt_cached_tokens_total") == cached > 0  # the third repeats the first
    assert grew("generated_tokens_total") == sum(u.completion_tokens for u in usages)
    assert grew("batch_passes_total") >= 3 * (MAX_TOKENS - 1)  # a decode step a token
    assert grew("time_to_first_token_seconds_total") > 0
    assert after["chatml_cache_bytes"] > 0 and after["chatml_cache_budget_bytes"] > 0
    assert after["chatml_queued_jobs"] == 0


def test_health_models_and_unknown_route(server):
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    c = client(server)
    assert c.models.list().data[0].id == "tiny"
    assert c.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found" and "'tiny'" in e.value.body["message"]
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


# ----- concurrency and memory ---------------------------------------------------------------


def conversation(c, k: int, turns: int, check=None) -> list[str]:
    messages = [{"role": "system", "content": "Parallel clients share this system prompt."}]
    answers = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"client {k} turn {t}"})
        answer = ask(c, messages, max_tokens=4).choices[0].message.content
        if check is not None:
            check()
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer})
    return answers


def test_parallel_clients_exact_and_within_budget(tiny, server):
    sequential = [conversation(client(server), k, 5) for k in range(4)]
    budget, old = tiny.budget, tiny.budget.max_bytes
    seen: list[tuple[int, int]] = []
    evictions = budget.evictions

    def check():
        with tiny.lock:  # between jobs: the model thread has enforced the budget
            seen.append((budget.used(), budget.max_bytes))

    # A pool smaller than the clients and a budget of a few sequences: LRU takeovers, forks
    # of the shared system prompt and evictions all happen.
    config = ServerConfig(port=0, context_window=WINDOW, sequences=3)
    try:
        with BackgroundServer(tiny, config) as srv:
            live = srv.app.worker.pool
            with tiny.lock:  # start from an empty store: earlier tests' caches go
                budget.max_bytes = 0
                budget.enforce()
                # About 6 sequences' live caches: the state this run caches exceeds it.
                budget.max_bytes = 5 << 20
            results: dict[int, list[str]] = {}

            def run(k):
                results[k] = conversation(client(srv), k, 5, check)

            threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            forks = live.forks
    finally:
        budget.max_bytes = old
    assert [results.get(k) for k in range(4)] == sequential
    assert len(seen) == 20 and all(used <= limit for used, limit in seen)
    assert forks > 0 and budget.evictions > evictions


# ----- output text (no model) ---------------------------------------------------------------


def _pieces(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize(
    "raw, thinking, stop",
    [
        ("  plain answer  with spaces \n", False, []),
        ("reasoning here\n</think>\n\nThe answer.", True, []),
        ("never finished thinking", True, []),
        (
            "Calling.\n<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n"
            "</tool_call>",
            False,
            [],
        ),  # fmt: skip
        ("bad <tool_call> markup", False, []),
        ("one two STOP three", False, ["STOP"]),
        ("think STOP more</think>x", True, ["STOP", "zz"]),
    ],
)
def test_streamed_deltas_add_up_to_the_message(raw, thinking, stop):
    out = OutputText(thinking, stop)
    reasoning = content = ""
    for piece in _pieces(raw):
        r, c = out.add(piece)
        reasoning, content = reasoning + r, content + c
    r, c = out.flush()
    reasoning, content = reasoning + r, content + c
    message = out.message()
    assert content == message.content
    assert reasoning == (message.reasoning or "")
    assert all(s not in content + reasoning for s in stop)
    if "<function=f>" in raw:
        assert message.content == "Calling."
        assert [(t.name, t.arguments) for t in message.tool_calls] == [("f", {"x": 1})]


def test_one_call_ends_the_answer_at_its_first_tool_call():
    call = "<tool_call>\n<function=f>\n<parameter=x>\n{}\n</parameter>\n</function>\n</tool_call>"
    raw = "Calling.\n" + call.format(1) + "\n" + call.format(2)
    for one_call, want in ((False, [1, 2]), (True, [1])):
        out = OutputText(False, one_call=one_call)
        content = "".join(out.add(piece)[1] for piece in _pieces(raw)) + out.flush()[1]
        assert out.stopped == one_call
        message = out.message()
        assert [t.arguments["x"] for t in message.tool_calls] == want
        assert content == message.content == "Calling."
    # A </tool_call> in the reasoning is no call: the answer goes on past it.
    out = OutputText(True, one_call=True)
    for piece in _pieces("I could write </tool_call> here.</think>\n" + call.format(3) + "x"):
        out.add(piece)
    assert out.stopped and out.raw.endswith("</tool_call>")
    assert [t.arguments["x"] for t in out.message().tool_calls] == [3]


def test_parallel_tool_calls_false_stops_after_the_first_call(tiny, server):
    # A grammar makes tiny write two calls; with parallel_tool_calls false it stops after the
    # first (no tokens spent on the second).
    import re

    call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n{}\n</parameter>\n"
            "</function>\n</tool_call>")  # fmt: skip
    two = re.escape("Checking.\n" + call.format("Paris") + "\n" + call.format("Rome"))
    c = client(server)
    messages = [{"role": "user", "content": "Weather?"}]
    answers = {}
    for parallel in (True, False):
        r = ask(c, messages, tools=TOOLS, max_tokens=120, parallel_tool_calls=parallel,
                response_format={"type": "regex", "regex": two})  # fmt: skip
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content == "Checking."
        answers[parallel] = ([json.loads(t.function.arguments)["city"]
                              for t in ch.message.tool_calls], r.usage.completion_tokens)  # fmt: skip
    assert answers[True][0] == ["Paris", "Rome"] and answers[False][0] == ["Paris"]
    assert answers[False][1] < answers[True][1]


def test_no_warm_flag_reaches_the_server(tiny, monkeypatch):
    for argv, warm in (([], True), (["--no-warm"], False)):
        assert serve_app(monkeypatch, tiny, [*argv, "--no-disk-cache"]).config.warm is warm
